"""PipeDream (weight stashing, vertical sync) and 2BW against a step-by-step reference."""

from __future__ import annotations

import copy

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.runtime.microbatch import split_microbatches
from pipecompile.schedule.schedules import make_schedule
from pipecompile.schedule.simulate import StageCosts, simulate
from tests.support.async_reference import AsyncReference

OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
}


def _model():
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=16, layers=6, heads=2, seq=8, tied=False).double()
    return model


def _batch(seed, size=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 32, (size, 8), generator=g)
    return x, (x + 1) % 32


def _compare(pipe, reference):
    ref = reference.parameters()
    names = [n for n, _ in pipe.named_parameters()]
    assert set(names) == set(ref)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), ref[name], rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _run(schedule, stages, optimizer, *, vertical_sync=False, microbatches=4, steps=3):
    model = _model()
    reference_model = copy.deepcopy(model)
    x, y = _batch(0)
    pipe = pc.compile(model, (x,), devices=stages, microbatches=microbatches, schedule=schedule,
                      loss_fn=zoo.lm_loss, optimizer=OPTIMIZERS[optimizer],
                      vertical_sync=vertical_sync)
    names = [list(s.parameter_names) for s in pipe.program.stages]
    reference = AsyncReference(reference_model, names, OPTIMIZERS[optimizer], schedule=schedule,
                               microbatches=microbatches, vertical_sync=vertical_sync)
    for step in range(steps):
        x, y = _batch(step)
        loss = pipe.step(x, target=y)
        mbs = [(mb.args, mb.kwargs, mb.target)
               for mb in split_microbatches((x,), {}, y, microbatches)]
        ref_losses = reference.run(mbs, zoo.lm_loss)
        torch.testing.assert_close(loss, torch.stack(ref_losses).mean(), rtol=1e-10, atol=0)
    _compare(pipe, reference)
    return pipe


@pytest.mark.parametrize("stages,optimizer", [(2, "sgd-momentum"), (3, "adamw"),
                                              (4, "sgd-momentum"), (4, "adamw")])
def test_pipedream_matches_reference(stages, optimizer):
    pipe = _run("pipedream", stages, optimizer)
    versions = pipe.runtime.weight_versions()
    for s, count in versions.items():
        assert count <= stages - s, (s, count)  # at most p - s versions on stage s
    assert versions[0] == stages  # and stage 0 really needs all of them


@pytest.mark.parametrize("stages", [3, 4])
def test_pipedream_vertical_sync_matches_reference(stages):
    _run("pipedream", stages, "sgd-momentum", vertical_sync=True)


@pytest.mark.parametrize("stages,optimizer", [(2, "adamw"), (3, "sgd-momentum"), (4, "adamw")])
def test_2bw_matches_reference(stages, optimizer):
    pipe = _run("2bw", stages, optimizer)
    assert max(pipe.runtime.weight_versions().values()) <= 2


def test_fit_stream_has_no_flush_and_matches_reference():
    stages, m, batches = 3, 4, 3
    model = _model()
    reference_model = copy.deepcopy(model)
    x, y = _batch(0)
    opt = OPTIMIZERS["sgd-momentum"]
    pipe = pc.compile(model, (x,), devices=stages, microbatches=m, schedule="pipedream",
                      loss_fn=zoo.lm_loss, optimizer=opt)
    data = [_batch(10 + b) for b in range(batches)]
    losses = pipe.fit([((bx,), by) for bx, by in data])
    assert len(losses) == batches

    reference = AsyncReference(reference_model,
                               [list(s.parameter_names) for s in pipe.program.stages],
                               opt, schedule="pipedream", microbatches=m)
    mbs = [(mb.args, mb.kwargs, mb.target)
           for bx, by in data for mb in split_microbatches((bx,), {}, by, m)]
    ref_losses = reference.run(mbs, zoo.lm_loss)  # one stream: i counts across batches
    for b in range(batches):
        torch.testing.assert_close(losses[b], torch.stack(ref_losses[b * m:(b + 1) * m]).mean(),
                                   rtol=1e-10, atol=0)
    _compare(pipe, reference)

    # measured: device 0 starts the next batch's forwards before the previous batch's last
    # backward, i.e. there is no flush between batches
    events = sorted((e for e in pipe.timeline().events if e.device == 0), key=lambda e: e.start)
    order = [str(e.action) for e in events]
    for b in range(batches - 1):
        last_backward = order.index(f"0B{(b + 1) * m - 1}")
        next_forward = order.index(f"0F{(b + 1) * m}")
        assert next_forward < last_backward
    # simulated: the stream's bubble is that of one pipeline fill, not one per batch
    costs = [StageCosts(1.0, 2.0)] * stages
    stream = simulate(pipe.last_step.schedule, costs).bubble_fraction
    assert abs(stream - (stages - 1) / (batches * m + stages - 1)) < 1e-9
    flushed = simulate(make_schedule("1f1b", stages, m), costs).bubble_fraction
    assert stream < flushed


def test_async_configuration_errors():
    model = _model()
    x, _ = _batch(0)
    with pytest.raises(pc.ConfigError, match="pass optimizer="):
        pc.compile(model, (x,), devices=2, schedule="pipedream", loss_fn=zoo.lm_loss)
    with pytest.raises(pc.ConfigError, match="vertical_sync"):
        pc.compile(model, (x,), devices=2, schedule="2bw", vertical_sync=True,
                   optimizer=OPTIMIZERS["adamw"], loss_fn=zoo.lm_loss)
    tied = zoo.GPT(vocab=32, dim=16, layers=2, heads=2, seq=8, tied=True)
    with pytest.raises(pc.ConfigError, match="own clock"):
        pc.compile(tied, (x,), devices=2, schedule="pipedream", loss_fn=zoo.lm_loss,
                   optimizer=OPTIMIZERS["adamw"])
    reused = zoo.KeywordTupleModel()  # one name, `encode.weight`, read at both ends
    y, scale = torch.randn(8, 12), torch.tensor(0.5)
    with pytest.raises(pc.ConfigError, match=r"parameter encode\.weight cannot be used by "
                                             r"stages \[0, 1\]"):
        pc.compile(reused, (y,), {"scale": scale}, devices=2, schedule="2bw",
                   loss_fn=zoo.tuple_loss, optimizer=OPTIMIZERS["adamw"])


def test_async_schedules_validate_and_keep_pipedream_order():
    schedule = make_schedule("pipedream", 3, 4)
    row = [str(a) for a in schedule.actions[0] if a.kind.value in ("F", "B", "STEP")]
    assert row == ["0F0", "0F1", "0F2", "0B0", "0STEP0", "0F3", "0B1", "0STEP1",
                   "0B2", "0STEP2", "0B3", "0STEP3"]
    two = make_schedule("2bw", 2, 2, batches=2)
    steps = [str(a) for a in two.actions[1] if a.kind.value == "STEP"]
    assert steps == ["1STEP1", "1STEP3"]
