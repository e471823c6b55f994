"""A compiled program's boundary values as the runtime and the cost model size them: their
shapes at given sizes and the bytes of every message (`schedule/messages.py` holds the pure
message IR these build on)."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..ir import evaluate
from ..schedule.messages import Dataflow, MessageKey

__all__ = ["value_shape", "message_bytes"]


def value_shape(program: Any, name: str, sizes: Mapping[Any, int]) -> tuple[int, ...]:
    """The shape of boundary value ``name`` when the size symbols have the values ``sizes``
    (`CapturedModel.sizes_at` a micro-batch size, or `sizes_of` a call's inputs)."""
    return tuple(int(evaluate(d, sizes)) for d in program.captured.values[name].shape)


def message_bytes(program: Any, microbatch_size: int) -> dict[MessageKey, int]:
    """Bytes of every message of a program's links at ``microbatch_size`` (a non-tensor value
    counts as an 8-byte int), keyed (sender, receiver, "F"/"B")."""
    sizes = program.captured.sizes_at(microbatch_size)

    def size(name: str) -> int:
        dtype = program.captured.values[name].dtype
        item = dtype.itemsize if dtype is not None else 8
        return item * math.prod(value_shape(program, name, sizes))

    result: dict[MessageKey, int] = {}
    for link in Dataflow.of(program).links:
        result[(link.src, link.dst, "F")] = sum(size(n) for n in link.values)
        if link.grads:
            result[(link.dst, link.src, "B")] = sum(size(n) for n in link.grads)
    return result
