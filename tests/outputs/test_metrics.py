"""pipe.metrics(): the last step as a flat dict of floats, each value checked against what it
summarises (the returned loss, the measured timeline, the cut's bytes, memory_stats)."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.outputs.cuts import cuts
from pipecompile.outputs.metrics import InputSizes, step_metrics
from pipecompile.runtime.microbatch import split_microbatches


@pytest.fixture(scope="module")
def stepped():
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=16, layers=4, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, schedule="1f1b",
                      loss_fn=zoo.lm_loss)
    loss = pipe.step(x, target=x)
    return pipe, loss


def test_metrics_summarise_the_last_step(stepped):
    pipe, loss = stepped
    m = pipe.metrics()
    assert all(isinstance(v, float) for v in m.values())
    timeline = pipe.timeline()
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-12)
    assert m["step_time_s"] == pytest.approx(timeline.makespan, rel=1e-12)
    assert m["bubble_fraction"] == pytest.approx(timeline.bubble_fraction, rel=1e-9)
    assert m["samples_per_s"] == pytest.approx(8 / timeline.makespan, rel=1e-12)
    assert m["tokens_per_s"] == pytest.approx(8 * 8 / timeline.makespan, rel=1e-12)
    (cut,) = cuts(pipe.program, microbatches=4)
    assert m["bytes_sent"] == 2 * 4 * cut.nbytes  # each micro-batch: the values and their grads
    memory = pipe.memory_stats()
    assert [m[f"peak_memory_bytes/device{d.device}"] for d in memory] == [
        float(d.total) for d in memory]
    assert sorted(m) == sorted(["loss", "step_time_s", "bubble_fraction", "samples_per_s",
                                "tokens_per_s", "bytes_sent", "peak_memory_bytes/device0",
                                "peak_memory_bytes/device1"])


def test_float_inputs_give_no_tokens_and_a_reduction_sees_every_value(stepped):
    pipe, _ = stepped
    x = torch.randn(6, 4)
    sizes = InputSizes.of(split_microbatches((x,), {}, None, 3))
    assert sizes == InputSizes(rows=6, tokens=None)
    seen = []

    def reduce(values, op):  # two replicas that each ran this step: sums double, maxima stay
        seen.append(op)
        return values * 2 if op == "sum" else values

    one = step_metrics(pipe.last_step, devices=2, memory=(), sizes=sizes)
    two = step_metrics(pipe.last_step, devices=2, memory=(), sizes=sizes, reduce=reduce,
                       replicas=2)
    assert seen == ["sum", "max"] and "tokens_per_s" not in one
    assert two["loss"] == pytest.approx(one["loss"]) and two["bytes_sent"] == 2 * one["bytes_sent"]
    # twice the devices busy twice as long: the same bubble
    assert two["bubble_fraction"] == pytest.approx(one["bubble_fraction"])
    # the rows each reduction saw, over the ranks of one pipeline (here 2 ranks "saw" a batch)
    assert two["samples_per_s"] == pytest.approx(one["samples_per_s"])


def test_a_fitted_stream_counts_every_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    data = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(3)]
    pipe = pc.compile(model, (data[0][0],), devices=2, microbatches=2, schedule="pipedream",
                      loss_fn=torch.nn.functional.mse_loss,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))
    losses = pipe.fit([((x,), y) for x, y in data])
    m = pipe.metrics()
    span = pipe.timeline().makespan
    assert m["samples_per_s"] == pytest.approx(3 * 8 / span, rel=1e-12)
    assert m["loss"] == pytest.approx(losses[-1].item(), rel=1e-12)  # the last batch's
    assert "tokens_per_s" not in m
