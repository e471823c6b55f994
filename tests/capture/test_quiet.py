"""Quiet export: torch's export loggers below ERROR and stderr writes are collected from the
exporting thread only (the error's details); other threads log and write as before, no logger's
level changes, and with TORCH_LOGS set torch logs as the user configured."""

from __future__ import annotations

import io
import logging
import sys
import threading

from pipecompile.capture.quiet import quiet as _quiet


def _torch_handler(name: str) -> tuple[logging.Logger, io.StringIO]:
    """A logger under torch._dynamo with a handler of its own writing to a buffer."""
    logger = logging.getLogger(name)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    return logger, stream


def test_quiet_collects_this_threads_records_and_changes_nothing_global():
    logger, shown = _torch_handler("torch._dynamo.test_quiet_child")
    levels = {n: logging.getLogger(n).level for n in ("torch._dynamo", "torch.export")}
    try:
        with _quiet(False) as collected:
            assert {n: logging.getLogger(n).level for n in levels} == levels
            logger.warning("guard failed: s0 > 1")
            logger.error("kept: an error")
            other = threading.Thread(target=logger.warning, args=("from another thread",))
            other.start()
            other.join()
        logger.warning("after the call")
    finally:
        logger.handlers.clear()
    assert "guard failed: s0 > 1" in collected.getvalue()
    assert shown.getvalue().splitlines() == ["kept: an error", "from another thread",
                                             "after the call"]


def test_with_torch_logs_set_torch_logs_as_configured(monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "+dynamic")
    logger, shown = _torch_handler("torch._dynamo.test_quiet_logs")
    try:
        with _quiet(False) as collected:
            logger.warning("guard failed: s0 > 1")
    finally:
        logger.handlers.clear()
    assert collected.getvalue() == ""
    assert shown.getvalue() == "guard failed: s0 > 1\n"


def test_a_pipecompile_record_in_the_exporting_thread_is_not_collected(caplog):
    with caplog.at_level(logging.INFO, logger="pipecompile"), _quiet(False) as collected:
        logging.getLogger("pipecompile.capture.test").info("still shown")
    assert [r.getMessage() for r in caplog.records] == ["still shown"]
    assert collected.getvalue() == ""


def test_stderr_writes_of_the_exporting_thread_only_are_collected(capsys):
    stderr = sys.stderr
    with _quiet(False) as collected:
        print("def forward(self, x): a partial graph", file=sys.stderr)
        other = threading.Thread(target=lambda: print("another thread", file=sys.stderr))
        other.start()
        other.join()
        with _quiet(False) as inner:  # nested (or another thread exporting): its own buffer
            print("inner", file=sys.stderr)
        print("outer again", file=sys.stderr)
    assert sys.stderr is stderr
    print("after", file=sys.stderr)
    assert collected.getvalue().splitlines() == ["def forward(self, x): a partial graph",
                                                 "outer again"]
    assert inner.getvalue() == "inner\n"
    assert capsys.readouterr().err.splitlines() == ["another thread", "after"]
