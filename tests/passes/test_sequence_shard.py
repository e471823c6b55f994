"""passes/sequence_shard: the tensor-parallel graphs with their tokens split between each row
and the next column, run by T threads with in-memory collectives, compute the unsplit graph's
outputs and gradients; a sequence T does not divide is refused."""

from __future__ import annotations

import copy

import pytest
import torch

from pipecompile.errors import ConfigError
from pipecompile.passes.sequence_shard import shard_sequence
from pipecompile.passes.tensor_shard import choose, lower
from tests.distributed.tensor_parallel_cases import MODELS
from tests.passes.test_tensor_shard import _stage, _unsplit
from tests.support.thread_ranks import Group, collectives, run_lowered


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ("gpt", "llama"):
        model, args, _, _, loss_fn = MODELS[name]()
        out[name] = (_stage(model, args, loss_fn), args)
    return out


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_split_tokens_compute_the_unsplit_graph(graphs, name):
    gm, args = graphs[name]
    plan = choose(gm, 2)
    want_gm = copy.deepcopy(gm)
    want = want_gm(*args)
    sum(o.sum() for o in want if o.is_floating_point()).backward()
    ranks, counts = run_lowered(gm, plan, args, sequence=True)
    # every row's all-reduce a reduce-scatter, every column's input gathered
    assert counts["reduce_scatter"] == len(plan.rows) == 4, counts
    assert counts["gather_column"] >= 3, counts  # the first layer's input arrives whole
    # the residual stream enters split once (layer 0's add), leaves whole once (the output
    # layer's input): norms, residual adds between run on half of the tokens
    assert counts["scatter"] == 1 and counts["gather"] == 1, counts
    for outs, _ in ranks:
        for got, ref in zip(outs, want):
            assert (got - ref).abs().max().item() <= 1e-12 * max(ref.abs().max().item(), 1)
    for pname, param in want_gm.named_parameters():
        if param.grad is None:
            continue
        if pname in plan.params:
            got = _unsplit([g[pname] for _, g in ranks], plan.params[pname], 2)
        else:  # replicated (norm weights included): all-reduced, identical
            got = ranks[0][1][pname]
            assert torch.equal(got, ranks[1][1][pname]), pname
        scale = param.grad.abs().max().item() or 1.0
        assert (got - param.grad).abs().max().item() <= 1e-10 * scale, pname


def test_a_sequence_t_does_not_divide_is_refused(graphs):
    gm, _ = graphs["gpt"]  # 8 tokens
    plan = choose(gm, 2)
    c, r, seq = collectives(Group(2), 0)
    lowered = lower(copy.deepcopy(gm), plan, copy=c, reduce=r)
    with pytest.raises(ConfigError, match="sequence of 8 tokens over tensor_parallel=3"):
        shard_sequence(lowered, 3, seq, copy=c, reduce=r)
