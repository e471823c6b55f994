"""A compiled program's boundary values as the runtime and the cost model size them: their
shapes at given sizes and the bytes of every message (`schedule/messages.py` holds the pure
message IR these build on)."""

from __future__ import annotations

from typing import Any, Mapping

from ..ir.records import evaluate
from ..schedule.messages import Dataflow, MessageKey, link_bytes

__all__ = ["value_shape", "message_bytes"]


def value_shape(program: Any, name: str, sizes: Mapping[Any, int]) -> tuple[int, ...]:
    """The shape of boundary value ``name`` when the size symbols have the values ``sizes``
    (`CapturedModel.sizes_at` a micro-batch size, or `sizes_of` a call's inputs)."""
    return tuple(int(evaluate(d, sizes)) for d in program.captured.values[name].shape)


def message_bytes(program: Any, microbatch_size: int) -> dict[MessageKey, float]:
    """Bytes of every message of a program's links at ``microbatch_size`` (a non-tensor value
    counts as an 8-byte int), keyed (sender, receiver, "F"/"B")."""
    sizes = program.captured.sizes_at(microbatch_size)
    values = program.captured.values
    return link_bytes(Dataflow.of(program), lambda name: values[name].bytes_at(sizes))
