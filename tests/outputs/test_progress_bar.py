"""The CLI's progress handler: on a terminal one bar rewritten in place (passes done, a long
loop's count), other records on lines above it, a newline at the end; elsewhere plain lines."""

from __future__ import annotations

import io
import logging

from pipecompile.ir import progress
from pipecompile.outputs.progress_bar import PlainLines, ProgressBar, progress_handler


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _logged(stream: io.StringIO, monkeypatch) -> str:
    """What the handler chosen for `stream` writes for one short compile's records."""
    monkeypatch.setenv("COLUMNS", "120")
    handler = progress_handler(lambda: stream)
    logger = logging.getLogger("pipecompile.test_progress_bar")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        logger.info("loading model.py:make")
        progress.pass_done("capture", 1.5, "35 nodes", index=1, count=4)
        loop = progress.Progress(logger, "layout search", 8, unit="layouts", every=0.0)
        loop.advance(4)
        loop.advance(4)
        progress.pass_done("search", 0.25, "1f1b", index=3, count=4)
        progress.passes_done(2, 4, 1.75)
    finally:
        logger.removeHandler(handler)
        handler.close()
    return stream.getvalue()


def test_a_terminal_gets_a_bar_rewritten_in_place(monkeypatch):
    passes = logging.getLogger("pipecompile")  # pass records go to pipecompile.passes
    terminal = _Terminal()
    handler = progress_handler(lambda: terminal)
    assert isinstance(handler, ProgressBar)
    passes.addHandler(handler)
    saved = passes.level
    passes.setLevel(logging.INFO)
    try:
        text = _logged(terminal, monkeypatch)
    finally:
        passes.removeHandler(handler)
        handler.close()
        passes.setLevel(saved)
    updates = text.split("\r\x1b[K")
    assert updates[0] == ""
    assert updates[1] == "pipecompile: loading model.py:make\n"
    assert updates[2:] == [
        "pipecompile: [#####...............] 1/4 passes, capture 1.50 s",
        updates[3], updates[4],
        "pipecompile: [###############.....] 3/4 passes, search 0.25 s",
        "pipecompile: [####################] 4/4 passes, all done 1.75 s\n"]
    assert updates[3].startswith("pipecompile: [##########..........] 4/8 layouts, layout search (")
    assert updates[4].startswith("pipecompile: [####################] 8/8 layouts, layout search (")
    assert text.endswith("\n") and text.count("\n") == 2


def test_a_line_between_two_bars_is_printed_above_the_bar(monkeypatch):
    terminal = _Terminal()
    handler = ProgressBar(lambda: terminal)
    logger = logging.getLogger("pipecompile.test_progress_bar.above")
    record = logger.makeRecord(logger.name, logging.INFO, __file__, 1, "%s", ("x",), None,
                               extra={"pipecompile_pass": ("split", 0.5, 2, 2)})
    handler.emit(record)
    handler.emit(logger.makeRecord(logger.name, logging.WARNING, __file__, 1, "careful", (),
                                   None))
    handler.close()
    assert terminal.getvalue() == (
        "\r\x1b[Kpipecompile: [####################] 2/2 passes, split 0.50 s"
        "\r\x1b[Kpipecompile: careful\n"
        "pipecompile: [####################] 2/2 passes, split 0.50 s\n")


def test_a_bar_is_cut_to_the_terminals_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    terminal = _Terminal()
    handler = ProgressBar(lambda: terminal)
    logger = logging.getLogger("pipecompile.test_progress_bar.narrow")
    handler.emit(logger.makeRecord(logger.name, logging.INFO, __file__, 1, "x", (), None,
                                   extra={"pipecompile_pass": ("partition", 0.5, 1, 2)}))
    line = terminal.getvalue().removeprefix("\r\x1b[K")
    assert line == "pipecompile: [##########" + ".." + "..."  # 26 characters, then "..."
    assert len(line) == 29


def test_elsewhere_each_record_is_a_plain_line(monkeypatch):
    stream = io.StringIO()
    assert type(progress_handler(lambda: stream)) is PlainLines
    passes = logging.getLogger("pipecompile")
    handler = progress_handler(lambda: stream)
    passes.addHandler(handler)
    saved = passes.level
    passes.setLevel(logging.INFO)
    try:
        _logged(stream, monkeypatch)
    finally:
        passes.removeHandler(handler)
        passes.setLevel(saved)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "pipecompile: loading model.py:make"
    assert lines[1] == "pipecompile: pass capture: 1.50 s: 35 nodes"
    assert lines[2].startswith("pipecompile: layout search: 4/8 layouts (")
    assert lines[4] == "pipecompile: pass search: 0.25 s: 1f1b"
    assert lines[5] == "pipecompile: passes: 2 of 4 ran in 1.75 s"
