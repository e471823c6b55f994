"""Micro-batching: split a batch's arguments into `m` micro-batches along dim 0.

Every tensor (positional, keyword, or the target) whose first dimension is the batch size is
split with `torch.chunk`, in order; every other value is given unchanged to each micro-batch.

    batch of 8, m = 4:  x[0:2] | x[2:4] | x[4:6] | x[6:8]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.utils import _pytree as pytree

from ..capture import batch_size_of
from ..errors import ConfigError

__all__ = ["MicroBatch", "split_microbatches"]


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
