"""passes/sequence_shard: the tensor-parallel graphs with their tokens split between each row
and the next column, run by T threads with in-memory collectives, compute the unsplit graph's
outputs and gradients; a sequence T does not divide is refused."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

from pipecompile.errors import ConfigError
from pipecompile.passes.sequence_shard import shard_sequence
from pipecompile.passes.tensor_shard import choose, lower
from pipecompile.runtime.tensor_parallel import local_slice
from tests.distributed.tensor_parallel_cases import MODELS
from tests.passes.test_tensor_shard import _stage, _unsplit


class _Group:
    """All-reduce and all-gather among T threads (in rank order)."""

    def __init__(self, size: int):
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def _all(self, rank: int, tensor: torch.Tensor) -> list:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got

    def all_reduce(self, rank, tensor):
        got = self._all(rank, tensor)
        return sum(got[1:], got[0].clone())

    def all_gather(self, rank, tensor, dim):
        return torch.cat(self._all(rank, tensor), dim)


def _ops(group: _Group, rank: int):
    T = group.size

    def function(forward, backward):
        class Op(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, dim):
                ctx.dim = dim
                return forward(x, dim)

            @staticmethod
            def backward(ctx, g):
                return backward(g, ctx.dim), None

        return lambda x, dim=None: Op.apply(x, dim)

    def gather(x, dim):
        return group.all_gather(rank, x, dim)

    def reduce_scatter(x, dim):
        return group.all_reduce(rank, x).chunk(T, dim)[rank].contiguous()

    def mine(x, dim):
        return x.chunk(T, dim)[rank].contiguous()

    ident = function(lambda x, d: x.view_as(x), lambda g, d: group.all_reduce(rank, g))
    red = function(lambda x, d: group.all_reduce(rank, x), lambda g, d: g)

    def tp_copy(x):
        return ident(x, 0)

    def tp_reduce(x):
        return red(x, 0)

    seq = {"reduce_scatter": function(reduce_scatter, gather),
           "gather_column": function(gather, reduce_scatter),
           "gather": function(gather, mine), "scatter": function(mine, gather)}
    return tp_copy, tp_reduce, seq


def _run(gm, plan, inputs):
    T = plan.degree
    group, results, counts = _Group(T), [None] * T, [None] * T

    def work(rank):
        try:
            c, r, seq = _ops(group, rank)
            module = lower(copy.deepcopy(gm), plan, copy=c, reduce=r, sequence=seq)
            counts[rank] = {k: sum(1 for n in module.graph.nodes if n.target is f)
                            for k, f in seq.items()}
            for name, p in list(module.named_parameters()):
                if name in plan.params:
                    owner, _, attr = name.rpartition(".")
                    setattr(module.get_submodule(owner), attr, nn.Parameter(
                        local_slice(p.detach(), plan.params[name], T, rank)))
            outs = module(*inputs)
            sum(o.sum() for o in outs if o.is_floating_point()).backward()
            results[rank] = (outs, {n: p.grad for n, p in module.named_parameters()})
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[rank] = exc
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(T)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results, counts[0]


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
    ranks, counts = _run(gm, plan, args)
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
    c, r, seq = _ops(_Group(2), 0)
    lowered = lower(copy.deepcopy(gm), plan, copy=c, reduce=r)
    with pytest.raises(ConfigError, match="sequence of 8 tokens over tensor_parallel=3"):
        shard_sequence(lowered, 3, seq, copy=c, reduce=r)
