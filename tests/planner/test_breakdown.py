"""Where the predicted step goes: parts by kind that sum to the step (planner/breakdown.py)."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.planner.breakdown import StepBreakdown, step_breakdown
from pipecompile.passes.kernel_prices import CHIPS, optimizer_seconds


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    model = zoo.GPT(vocab=512, dim=256, layers=4, heads=4, seq=256).to(torch.bfloat16)
    ids = torch.randint(0, 512, (8, 256))
    return pc.compile(model, (ids,), devices=[pc.preset("a100")] * 2, schedule="gpipe",
                      microbatches=4, data_parallel=1, checkpoint=False,
                      optimizer=lambda p: torch.optim.AdamW(p))


def test_the_parts_sum_to_the_predicted_step(pipe):
    parts = step_breakdown(pipe.plan)
    assert isinstance(parts, StepBreakdown)
    assert parts.step == pipe.predicted.makespan
    assert sum(parts.parts().values()) == pytest.approx(parts.step, rel=1e-12)
    # every kind of kernel is there; compute is split by kind, none left unsplit
    assert min(parts.matmul, parts.attention, parts.memory, parts.launch) > 0
    assert parts.compute == 0.0
    # GPipe on 2 devices, 4 micro-batches: the busiest device idles while the other fills
    assert parts.bubble > 0 and parts.overhead > 0 and parts.communication >= 0


def test_the_optimizer_step_is_its_stages_bytes_at_memory_bandwidth(pipe):
    parts = step_breakdown(pipe.plan)
    bounds = pipe.plan.placement.bounds
    stages = [s for s, d in enumerate(pipe.schedule.stage_to_device) if d == parts.device]
    blocks = [c for s in stages for c in pipe.plan.costs.symbolic[bounds[s]:bounds[s + 1]]]
    param = sum(float(c.param_bytes) for c in blocks)
    state = sum(float(c.optimizer_bytes) for c in blocks)
    # torch's AdamW over bf16 parameters (2 bf16 moments: 4 bytes per parameter), run as
    # its foreach kernels (kernel_prices.adam_passes: p 4, g 2, the state 7 passes), with
    # torch's clipping (6 passes over the gradients, measured): 2 x (4 + 2 + 2 x 7 + 6) = 52
    # bytes a parameter
    expected = optimizer_seconds(CHIPS["a100"].bandwidth, param, param, state,
                                 passes=(4, 2, 7))
    assert expected == pytest.approx(param / 2 * 52 / CHIPS["a100"].bandwidth)
    assert state == pytest.approx(2 * param)
    assert parts.optimizer == pytest.approx(expected) and parts.collectives == pytest.approx(0.0)


def test_explain_shows_where_the_step_goes(pipe):
    text = pipe.explain()
    parts = step_breakdown(pipe.plan)
    assert f"predicted step {parts.step * 1e3:.3f} ms, as device {parts.device}" in text
    for label in ("matmul kernels", "fused attention", "memory-bound kernels",
                  "optimizer step + clipping", "bubble (idle)"):
        assert label in text


class _WithLoss(torch.nn.Module):
    """A GPT whose forward ends in the fp32 cross-entropy over its vocabulary."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 target.reshape(-1))


def test_the_loss_over_a_vocabulary_is_named_apart_from_other_memory_bound_kernels():
    """Cross-entropy over 32,000 fp32 logits per token (rows longer than shared memory
    holds) is its own part: its forward and backward bytes at the memory-bound rate
    (kernel_prices.cross_entropy_bytes), per micro-batch, on the device that runs it."""
    from pipecompile.passes.kernel_prices import cross_entropy_bytes

    vocab, seq, batch, m = 32000, 256, 16, 2
    with torch.device("meta"):
        model = _WithLoss(zoo.GPT(vocab=vocab, dim=64, layers=2, heads=2, seq=seq)
                          ).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    pipe = pc.compile(model, (ids, ids), devices=[pc.preset("a100")] * 2, schedule="gpipe",
                      microbatches=m, data_parallel=1, checkpoint=False)
    parts = step_breakdown(pipe.plan)
    assert sum(parts.parts().values()) == pytest.approx(parts.step, rel=1e-12)
    rows = batch // m * seq
    moved = m * (cross_entropy_bytes(rows, vocab, 4)
                 + cross_entropy_bytes(rows, vocab, 4, backward=True))
    # the busiest device runs the last stage: the output layer and the loss
    assert parts.device == pipe.schedule.stage_to_device[-1]
    assert parts.loss == pytest.approx(moved / CHIPS["a100"].bandwidth, rel=1e-6)
    assert parts.memory > 0  # the other memory-bound kernels (the logits' cast, norms)
    assert "loss over the vocabulary" in pipe.explain()


def test_an_optimizer_with_fp32_master_weights_is_priced_as_megatrons_step():
    """compile's optimizer keeping fp32 master weights and moments of the bf16 parameters in
    its state: 12 bytes of state a parameter, and a step of 52 bytes a parameter
    (kernel_prices.mixed_precision_bytes without a loss scale) at the memory-bound rate."""
    from pipecompile.passes.kernel_prices import mixed_precision_bytes
    from tests.passes.test_annotate import MasterWeightsAdamW

    torch.manual_seed(0)
    model = zoo.GPT(vocab=512, dim=256, layers=4, heads=4, seq=256).to(torch.bfloat16)
    ids = torch.randint(0, 512, (8, 256))
    pipe = pc.compile(model, (ids,), devices=[pc.preset("a100")] * 2, schedule="gpipe",
                      microbatches=4, data_parallel=1, checkpoint=False,
                      optimizer=MasterWeightsAdamW)
    parts = step_breakdown(pipe.plan)
    bounds = pipe.plan.placement.bounds
    stages = [s for s, d in enumerate(pipe.schedule.stage_to_device) if d == parts.device]
    blocks = [c for s in stages for c in pipe.plan.costs.symbolic[bounds[s]:bounds[s + 1]]]
    params = sum(float(c.param_bytes) for c in blocks) / 2
    assert sum(float(c.optimizer_bytes) for c in blocks) == pytest.approx(12 * params)
    assert parts.optimizer == pytest.approx(
        params * mixed_precision_bytes(loss_scale=False) / CHIPS["a100"].bandwidth)
