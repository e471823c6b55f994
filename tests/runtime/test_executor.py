"""Executor (in-process, one thread per device): every synchronous schedule equals the unsplit model (float64)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

import pipecompile as pc
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def _check(name, schedule, devices, microbatches=4, **options):
    torch.manual_seed(0)
    case = CASES[name]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=devices,
                      microbatches=microbatches, schedule=schedule, loss_fn=case.loss_fn,
                      **options)
    loss = pipe.step(*case.args, target=case.target, **case.kwargs)
    ref_loss, ref_grads = reference_step(reference, case.args, case.kwargs, case.target,
                                         case.loss_fn, microbatches)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads)) == len(ref_grads)
    ref_state = reference.state_dict()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, ref_state[key]), key
    return pipe


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_matches_unsplit_model_gpt2(schedule, devices):
    pipe = _check("gpt2", schedule, devices)
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    assert len(pipe.program.stages) == devices * virtual
    # what ran: a forward and a backward (I and W under zero-bubble) per stage and micro-batch
    ran = Counter(e.action.kind.value for e in pipe.timeline().events)
    count = devices * virtual * 4
    backward = {"I": count, "W": count} if schedule == "zb-h1" else {"B": count}
    assert {k: ran[k] for k in ("F", "B", "I", "W") if ran[k]} == {"F": count, **backward}


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("name", ["unet", "residual_cnn", "keyword_tuple"])
def test_schedule_matches_unsplit_model_skips_and_buffers(name, schedule):
    _check(name, schedule, 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_checkpointing_gives_the_same_gradients(schedule):
    _check("gpt", schedule, 2, checkpoint=True)


def test_single_thread_interleaving_gives_the_same_gradients():
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=4, schedule="1f1b", microbatches=4,
                      loss_fn=case.loss_fn)
    pipe.runtime.executor.threads = False
    pipe.step(*case.args, target=case.target)
    _, ref_grads = reference_step(reference, case.args, {}, case.target, case.loss_fn, 4)
    assert_grads_equal(pipe, ref_grads)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_measured_inflight_matches_simulator(schedule):
    torch.manual_seed(0)
    case = CASES["gpt"]()
    pipe = pc.compile(case.model, case.args, devices=4 if schedule != "interleaved-1f1b" else 2,
                      microbatches=8, schedule=schedule, loss_fn=case.loss_fn)
    pipe.step(*case.args, target=case.target)
    measured = pipe.last_step.peak_inflight
    predicted = tuple(pipe.predicted.peak_inflight(s) for s in range(len(pipe.program.stages)))
    assert measured == predicted, (measured, predicted)
    if schedule == "gpipe":
        assert measured[0] == 8
    elif schedule == "1f1b":
        assert measured == (4, 3, 2, 1)


def test_timeline_has_every_action_and_exports(tmp_path):
    import json

    torch.manual_seed(0)
    case = CASES["gpt"]()
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=4, schedule="1f1b",
                      loss_fn=case.loss_fn)
    pipe.step(*case.args, target=case.target)
    timeline = pipe.timeline()
    compute = [e for e in timeline.events if e.action.kind.value in ("F", "B")]
    assert len(compute) == 2 * 2 * 4
    for e in timeline.events:
        assert e.end >= e.start >= 0
    # on each device, actions ran in schedule order without overlapping
    for device in range(2):
        events = [e for e in timeline.events if e.device == device]
        assert all(a.end <= b.start + 1e-9 for a, b in zip(events, events[1:]))
    trace = json.loads(open(pipe.write_chrome_trace(str(tmp_path / "t.json"))).read())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [str(e.action) for e in timeline.events]
    png = pipe.plot_timeline(str(tmp_path / "gantt.png"))
    assert open(png, "rb").read(8).startswith(b"\x89PNG")
    svg = pipe.plot_timeline(str(tmp_path / "gantt.svg"))
    assert "<svg" in open(svg).read(2000)


def test_each_cuda_row_keeps_one_stream_across_steps(monkeypatch):
    """A CUDA row runs on a stream made once, not one per step: the caching allocator pools
    blocks per stream, and a new stream each step made 158 cudaMalloc calls a step on an H200."""
    from pipecompile.runtime import executor as ex

    made = []

    class FakeStream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(ex.torch.cuda, "Stream", FakeStream)
    runner = ex.Executor.__new__(ex.Executor)
    runner._streams = {}
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    first = [runner._stream(0, gpu0), runner._stream(1, gpu1), runner._stream(2, gpu0)]
    again = [runner._stream(0, gpu0), runner._stream(1, gpu1), runner._stream(2, gpu0)]
    assert [a is b for a, b in zip(first, again)] == [True, True, True]
    assert len({id(s) for s in first}) == 3 and made == [gpu0, gpu1, gpu0]
    assert runner._stream(0, torch.device("cpu")) is None
