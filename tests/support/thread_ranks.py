"""T tensor-parallel ranks as T threads of one process: in-memory collectives (summed in rank
order) wrapped as the autograd functions the lowering inserts, and a lowered stage graph run on
every rank with its slice of each split parameter (tests/passes: tensor_shard, sequence_shard).
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn as nn

from pipecompile.passes.tensor_shard import lower
from pipecompile.runtime.tensor_parallel import local_slice, vocab_lookup


class Group:
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


def collectives(group: Group, rank: int):
    """(copy, reduce, the sequence-parallel collectives by name) of `rank`."""
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


def run_lowered(gm, plan, inputs, *, sequence: bool = False):
    """Each rank's (outputs, {name: gradient of its local parameter}) for the sum of the
    outputs, and how many of each sequence collective rank 0's graph holds."""
    T = plan.degree
    group, results, counts = Group(T), [None] * T, [None] * T

    def work(rank):
        try:
            c, r, seq = collectives(group, rank)
            module = lower(copy.deepcopy(gm), plan, copy=c, reduce=r,
                           sequence=seq if sequence else None,
                           vocab={"lookup": vocab_lookup(rank), "gather": seq["gather"]})
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
