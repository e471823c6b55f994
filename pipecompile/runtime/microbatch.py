"""Micro-batching: split a batch's arguments into `m` micro-batches along dim 0.

Every tensor (positional, keyword, or the target) whose first dimension is the batch size is
split with `torch.chunk`, in order; every other value is given unchanged to each micro-batch.

    batch of 8, m = 4:  x[0:2] | x[2:4] | x[4:6] | x[6:8]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.utils import _pytree as pytree

from ..errors import ConfigError
from ..ir.records import CapturedModel, batch_size_of

__all__ = ["MicroBatch", "forward_in_chunks", "split_microbatches"]


@dataclass(frozen=True)
class MicroBatch:
    """The arguments and target of one micro-batch."""

    index: int
    args: tuple
    kwargs: Mapping[str, Any]
    target: Any
    size: int


def split_microbatches(
    args: tuple, kwargs: Mapping[str, Any], target: Any, num: int
) -> list[MicroBatch]:
    """`num` micro-batches of (args, kwargs, target), chunked along the batch dimension."""
    batch = batch_size_of(args, kwargs)
    if batch < num:
        raise ConfigError(
            f"a batch of {batch} cannot be split into microbatches={num}; use a batch of at "
            f"least {num} samples or fewer micro-batches"
        )
    sizes = _chunk_sizes(batch, num)
    if len(sizes) != num:
        raise ConfigError(
            f"torch.chunk splits a batch of {batch} into {len(sizes)} pieces, not "
            f"microbatches={num}; use a batch size divisible by {num}"
        )

    def chunks(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            return leaf.chunk(num)
        return None

    if not kwargs and all(isinstance(a, torch.Tensor) for a in (*args, target)
                          if a is not None):  # tensors only: no pytree walk per micro-batch
        pieces = [chunks(a) for a in args]
        aims = chunks(target)
        return [MicroBatch(i, tuple(a if p is None else p[i] for a, p in zip(args, pieces)), {},
                           target if aims is None else aims[i], sizes[i]) for i in range(num)]
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs), target))
    pieces = [chunks(leaf) for leaf in leaves]
    out = []
    for i in range(num):
        mb_leaves = [leaf if p is None else p[i] for leaf, p in zip(leaves, pieces)]
        mb_args, mb_kwargs, mb_target = pytree.tree_unflatten(mb_leaves, spec)
        out.append(MicroBatch(i, mb_args, mb_kwargs, mb_target, sizes[i]))
    return out


def _chunk_sizes(batch: int, num: int) -> list[int]:
    """The sizes of `torch.chunk(num)`'s pieces of `batch` rows, computed (not allocated):
    pieces of ceil(batch / num) rows, the last one what remains."""
    size = -(-batch // num)
    pieces = -(-batch // size)
    return [size] * (pieces - 1) + [batch - size * (pieces - 1)]


def forward_in_chunks(forward: Callable[[tuple, dict], Any], captured: CapturedModel,
                      args: tuple, kwargs: dict, batch: int) -> Any:
    """A statically captured model called with a multiple of its captured batch size: run in
    chunks of that size, outputs with that leading size concatenated."""
    size = captured.captured_batch_size
    if batch % size:
        raise ConfigError(
            f"this model was captured with static shapes for batch {size} "
            f"({'; '.join(captured.notes)}); call it with a multiple of {size}")
    chunks = split_microbatches(args, kwargs, None, batch // size)
    leaves = [pytree.tree_flatten(forward(c.args, dict(c.kwargs))) for c in chunks]
    merged = []
    for parts in zip(*[l for l, _ in leaves]):
        if not (isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0
                and parts[0].shape[0] == size):
            raise ConfigError(
                "a statically captured model's output has no batch dimension to join chunks "
                f"along; call it with the captured batch size {size}")
        merged.append(torch.cat(parts))
    return pytree.tree_unflatten(merged, leaves[0][1])
