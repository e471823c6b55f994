"""The CLI shows compile's progress on stderr: plain per-pass lines when stderr is not a
terminal, a progress bar rewritten with \\r (ending with a newline) on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a preset's devices: nothing measured, so the compile takes seconds
COMMAND = [sys.executable, "-m", "pipecompile", "plan", "examples/factories.py:keyword_tuple",
           "--devices", "2", "--device", "h100"]


def test_without_a_terminal_each_pass_is_a_plain_line():
    done = subprocess.run(COMMAND, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    lines = done.stderr.splitlines()
    assert all(line.startswith("pipecompile: ") for line in lines)
    passes = [re.match(r"pipecompile: pass (\w+): [\d.]+ s", line) for line in lines]
    names = [m.group(1) for m in passes if m]
    assert {"capture", "search", "partition", "split", "simulate"} <= set(names)
    summary = [line for line in lines if line.startswith("pipecompile: passes: ")]
    assert len(summary) == 1
    ran, count = map(int, re.match(r"pipecompile: passes: (\d+) of (\d+) ran in", summary[0])
                     .groups())
    assert ran == len(names) and count >= ran
    assert lines[-1].startswith("pipecompile: compiled in ")


def test_on_a_terminal_a_bar_is_rewritten_in_place_and_ends_with_a_newline():
    leader, follower = pty.openpty()
    try:
        run = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=follower, cwd=ROOT,
                               env=dict(os.environ, COLUMNS="200"))
    finally:
        os.close(follower)
    chunks = []
    deadline = time.monotonic() + 900  # far above a loaded machine's time: a hang fails
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 5.0)
            if not ready:
                continue
            try:
                data = os.read(leader, 65536)
            except OSError:  # the child closed the terminal (EIO on Linux)
                break
            if not data:
                break
            chunks.append(data)
        else:
            run.kill()
    finally:
        os.close(leader)
    out, _ = run.communicate(timeout=900)
    assert run.returncode == 0
    assert out.startswith(b"Pipeline: 2 stages")  # stdout is not the terminal: untouched
    text = b"".join(chunks).decode().replace("\r\n", "\n")  # the terminal adds \r to \n
    updates = text.split("\r\x1b[K")
    bars = [u for u in updates if u.startswith("pipecompile: [")]
    assert any(re.fullmatch(r"pipecompile: \[[#.]{20}\] \d+/\d+ passes, capture [\d.]+ s", u)
               for u in bars)
    assert any(" candidates, schedule search on 2 devices (" in u for u in bars)
    assert "pipecompile: compiling KeywordTupleModel for 2 NVIDIA H100" in text
    assert "pipecompile: pass capture:" not in text  # passes are bar updates, not lines
    # the last bar says every pass is done, and the command ends it with a newline
    assert re.search(r"pipecompile: \[#{20}\] (\d+)/\1 passes, all done [\d.]+ s\n$", text)
