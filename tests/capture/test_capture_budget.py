"""capture_budget: the torch.export attempt with every size symbolic runs first in a child
process killed at the budget; past it capture keeps the batch alone symbolic, says so in
explain(), and the pipeline still trains exactly. By default (symbolic_sizes="auto") that
attempt is not made at all. The model: MaxViT's block and grid attention, whose partition
reshapes keep sympy busy for minutes with every input size symbolic (seconds with the batch
alone). No exception is raised into any thread: many bounded captures in a row, with garbage
collection between them, leave nothing behind."""

from __future__ import annotations

import copy
import gc
import pathlib
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.capture import bounded, export
from pipecompile.capture.export import capture_export
from tests.support.capture_models import TinyMaxVit
from tests.support.reference import assert_grads_equal, reference_step

_CUT = ("export with every input size symbolic did not finish within capture_budget=2 s; "
        "captured with only the batch symbolic")


def _maxvit():
    torch.manual_seed(0)
    model = TinyMaxVit().double()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    return model, x, torch.randint(0, 5, (4,))


def test_maxvit_past_the_budget_falls_back_says_so_and_trains_exactly():
    model, x, y = _maxvit()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="gpipe",
                      loss_fn=F.cross_entropy, capture_budget=2, symbolic_sizes="all")
    captured = pipe.program.captured
    assert _CUT in pipe.explain() and captured.notes[0] == _CUT
    assert captured.dynamic_batch and len(captured.example_sizes) == 1  # the batch alone
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, F.cross_entropy, 2)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads)


def test_by_default_no_attempt_waits_on_the_budget(monkeypatch):
    """symbolic_sizes="auto": the batch alone is symbolic at first; no child is forked, so a
    MaxViT-style model compiles in the seconds its batch-only export takes."""
    forks: list[float] = []
    real = bounded.finishes_within
    monkeypatch.setattr(export, "finishes_within",
                        lambda s, fn: forks.append(s) or real(s, fn))
    model, x, y = _maxvit()
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="gpipe",
                      loss_fn=F.cross_entropy, capture_budget=2)
    captured = pipe.program.captured
    assert forks == [] and captured.notes == ()
    assert captured.dynamic_batch and len(captured.example_sizes) == 1
    loss = pipe.step(x, target=y)
    ref_loss, _ = reference_step(copy.deepcopy(model), (x,), {}, y, F.cross_entropy, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)


def test_the_budget_holds_when_capture_runs_in_another_thread():
    model, x, _ = _maxvit()
    got: dict = {}

    def run():
        got["captured"] = capture_export(model, (x,), {}, 4, static_batch_size=2, opaque=True,
                                         verbose=False, sizes="all", budget=1)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=300)
    captured = got["captured"]
    assert captured.notes[0] == _CUT.replace("=2 s", "=1 s")
    flat = captured.flatten_inputs((x[:2],), {})
    with torch.no_grad():
        torch.testing.assert_close(captured.module(*flat)[0], copy.deepcopy(model)(x[:2]),
                                   rtol=0, atol=0)


def test_many_bounded_captures_with_garbage_collection_leave_nothing_behind(monkeypatch):
    """The budget cases again and again, in this thread and another, with gc.collect between
    them: no exception reaches an unraisable hook, a thread's excepthook or the caller, and
    every capture computes the model."""
    escaped: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook",
                        lambda u: escaped.append(f"unraisable {u.exc_type.__name__}"))
    monkeypatch.setattr(threading, "excepthook",
                        lambda a: escaped.append(f"thread {a.exc_type.__name__}"))
    model, x, _ = _maxvit()
    with torch.no_grad():
        want = copy.deepcopy(model)(x[:2])

    def capture_once(results: list) -> None:
        captured = capture_export(model, (x,), {}, 4, static_batch_size=2, opaque=True,
                                  verbose=False, sizes="all", budget=0.2)
        results.append(captured)

    results: list = []
    for i in range(6):
        if i % 2:
            worker = threading.Thread(target=capture_once, args=(results,))
            worker.start()
            worker.join(timeout=300)
        else:
            capture_once(results)
        gc.collect()
        assert escaped == [], escaped
    assert len(results) == 6
    for captured in results:
        assert captured.notes[0] == _CUT.replace("=2 s", "=0.2 s")
        with torch.no_grad():
            got = captured.module(*captured.flatten_inputs((x[:2],), {}))[0]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    gc.collect()
    assert escaped == [], escaped


def test_no_exception_is_raised_into_a_thread_anywhere_in_the_package():
    package = pathlib.Path(pc.__file__).parent
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if "SetAsyncExc" in p.read_text()]
    assert offenders == []


def test_budget_zero_or_negative_is_refused():
    with pytest.raises(pc.ConfigError, match="capture_budget must be a positive number"):
        pc.compile(torch.nn.Linear(3, 3), (torch.randn(4, 3),), devices=2, capture_budget=-1)
