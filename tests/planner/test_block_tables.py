"""The block costs a search prices its candidates with: one linearisation per stage count,
one cost table per (granularity, micro-batch size)."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
from pipecompile.ir.records import Example
from pipecompile.planner.block_tables import BlockTables, coarsest, enough_blocks


def _plan_and_example():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=lambda out, y: (out - y).pow(2).mean())
    return pipe.plan, Example(model, (x,), {})


def test_each_table_is_made_once_and_a_stage_count_without_blocks_has_none():
    plan, example = _plan_and_example()
    tables = BlockTables(plan, example, None)
    linear, costs = tables.at(2, 4, 2)
    assert linear.num_blocks >= 2 and len(costs.blocks) == linear.num_blocks
    again = tables.at(2, 4, 2)
    assert again[0] is linear and again[1] is costs  # kept, not costed again
    _, half = tables.at(2, 2, 4)
    assert half is not costs  # another micro-batch size: its own table
    assert half.blocks[0].forward_flops == pytest.approx(costs.blocks[0].forward_flops / 2)
    assert tables.at(10_000, 4, 2) is None


def test_coarsest_gives_every_stage_a_block_or_says_how_many_there_are():
    plan, _ = _plan_and_example()
    captured = plan.ready.captured
    linear = coarsest(captured, None, 2)
    assert linear.num_blocks >= 2
    with pytest.raises(pc.PartitionError, match=f"only {linear.num_blocks} blocks"):
        enough_blocks(linear, linear.num_blocks + 1, None)


def test_a_bf16_models_optimizer_state_is_probed_in_bf16():
    """The blocks' optimizer bytes come from stepping compile's optimizer on a probe of the
    model's dtype: fp32 master weights and moments of bf16 parameters are 6x the parameter
    bytes, torch's AdamW over bf16 parameters 2x (its moments are bf16)."""
    from tests.passes.test_annotate import MasterWeightsAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).to(torch.bfloat16)
    x = torch.randn(8, 8, dtype=torch.bfloat16)
    for optimizer, factor in ((MasterWeightsAdamW, 6), (lambda p: torch.optim.AdamW(p), 2)):
        pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                          loss_fn=lambda out, y: (out.float() - y.float()).pow(2).mean(),
                          optimizer=optimizer)
        costs = [c for c in pipe.plan.costs.symbolic if c.param_bytes]
        assert costs and all(c.optimizer_bytes == factor * c.param_bytes for c in costs)
