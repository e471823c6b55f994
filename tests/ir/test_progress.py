"""Progress: compile logs each pass at INFO as it ends, with its time, under `pipecompile.*`
loggers and no prefix of their own; long loops log counts; under torchrun only rank 0 logs at
INFO unless PIPECOMPILE_LOG_RANKS says otherwise."""

from __future__ import annotations

import logging

import pytest
import torch

import pipecompile as pc
from pipecompile.ir import progress
from pipecompile.ir.progress import Progress, level


@pytest.mark.parametrize("env,expected", [
    ({}, logging.INFO), ({"RANK": "0"}, logging.INFO), ({"RANK": "1"}, logging.DEBUG),
    ({"RANK": "1", "PIPECOMPILE_LOG_RANKS": "all"}, logging.INFO),
    ({"RANK": "3", "PIPECOMPILE_LOG_RANKS": "0, 3"}, logging.INFO),
    ({"RANK": "2", "PIPECOMPILE_LOG_RANKS": "0,3"}, logging.DEBUG)])
def test_rank_zero_logs_at_info_by_default(env, expected):
    assert level(env) == expected


def test_a_loop_logs_its_counts_when_slow_enough(caplog):
    logger = logging.getLogger("pipecompile.test")
    with caplog.at_level(logging.INFO, logger="pipecompile"):
        loop = Progress(logger, "layout search", 3, unit="layouts", every=0.0)
        for k in range(3):
            loop.advance(note=f"best so far {k} ms")
        loop.done()
        quiet = Progress(logger, "fast", 3, every=60.0)
        quiet.advance()
        quiet.done()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "layout search: 1/3 layouts", "layout search: 2/3 layouts", "layout search: 3/3 layouts",
        "layout search: 3/3 layouts"]
    assert lines[0].endswith("s), best so far 0 ms") and lines[-1].endswith("s), done")


def test_compile_logs_each_pass_with_its_time_and_the_search_counts(caplog, monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 0.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    with caplog.at_level(logging.INFO, logger="pipecompile"):
        pipe = pc.compile(model, (x,), devices=2, loss_fn=torch.nn.functional.mse_loss)
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    passes = [m for name, m in messages if name == "pipecompile.passes"]
    assert [m.split(":")[0] for m in passes] == [f"pass {p.name}" for p in pipe.plan.passes]
    for line, record in zip(passes, pipe.plan.passes):
        assert line.startswith(f"pass {record.name}: {record.seconds:.2f} s")
    searched = [m for name, m in messages if name == "pipecompile.planner.schedule_search"]
    assert searched and all(m.startswith("schedule search on 2 devices: ") for m in searched)
    assert any(" candidates (" in m for m in searched)
    assert not any(m.startswith("pipecompile:") for _, m in messages)
    assert all(name.startswith("pipecompile.") for name, _ in messages)


def test_other_ranks_log_passes_at_debug(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.DEBUG, logger="pipecompile"):
        progress.pass_done("capture", 1.5, "3 nodes")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "pass capture: 1.50 s: 3 nodes")]


def test_reporting_every_sets_a_loops_interval_within_its_block(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS_EVERY_S", 7.0)
    logger = logging.getLogger("pipecompile.test")
    with progress.reporting_every(0.25):
        inside = Progress(logger, "search", 2)
        assert Progress(logger, "search", 2, every=3.0).every == 3.0  # an explicit one wins
    assert inside.every == 0.25
    assert Progress(logger, "search", 2).every == 7.0


def test_records_carry_their_numbers_for_a_progress_bar(caplog):
    logger = logging.getLogger("pipecompile.test")
    with caplog.at_level(logging.INFO, logger="pipecompile"):
        progress.pass_done("split", 0.5, "2 stage graphs", index=3, count=9)
        progress.passes_done(7, 9, 2.25)
        loop = Progress(logger, "layout search", 4, unit="layouts", every=0.0)
        loop.advance(3)
    split, ended, looped = caplog.records
    assert split.pipecompile_pass == ("split", 0.5, 3, 9)
    assert ended.name == "pipecompile.compile"
    assert ended.getMessage() == "passes: 7 of 9 ran in 2.25 s"
    assert ended.pipecompile_pass == ("all", 2.25, 9, 9)
    what, count, total, unit, seconds = looped.pipecompile_progress
    assert (what, count, total, unit) == ("layout search", 3, 4, "layouts") and seconds >= 0


def test_under_a_bar_a_loops_first_item_is_shown_at_once(caplog):
    """A bar names every loop however fast it runs: its first item is logged at once, the
    next ones every `reporting_every` seconds (a fast machine once skipped a whole loop)."""
    logger = logging.getLogger("pipecompile.test")
    with caplog.at_level(logging.INFO, logger="pipecompile"):
        with progress.reporting_every(3600.0):
            loop = Progress(logger, "schedule search", 9, unit="candidates")
            loop.advance()
            loop.advance()
        quiet = Progress(logger, "schedule search", 9, unit="candidates")  # no bar: no line
        quiet.advance()
    assert [r.pipecompile_progress[:4] for r in caplog.records] == [
        ("schedule search", 1, 9, "candidates")]
