"""The cuts of a staged program and the tensors that cross each one.

Cut j sits between stage j and stage j+1; its boundary is every value produced by a stage <= j
and read by a stage > j (a skip connection crosses every cut between its producer and its last
reader, although the runtime sends it straight to the readers). Sizes are per micro-batch:

    cuts(program, microbatches=4)
      -> (Cut(0, after 'transformer.h.1', 1 value, 4.0 KiB), ...)
    Cut.values[0] -> BoundaryValue('add_11', shape ('batch', 8, 64), microbatch_shape (2, 8, 64),
                                   dtype 'float32', nbytes 4096, producer 0, consumers (1,))
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ..ir.records import evaluate
from ..ir.records import StagedProgram
from ..ir.formats import format_bytes

__all__ = ["BoundaryValue", "Cut", "cuts", "microbatch_size"]


@dataclass(frozen=True)
class BoundaryValue:
    """One value crossing a cut: symbolic shape (the batch size is "batch") and its size for
    one micro-batch."""

    name: str
    shape: tuple[str | int, ...]
    microbatch_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    producer: int
    consumers: tuple[int, ...]

    def __repr__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}] {format_bytes(self.nbytes)}"


@dataclass(frozen=True)
class Cut:
    """The cut after stage `index`, at the end of block `after_block` (named `block_name`)."""

    index: int
    after_block: int
    block_name: str
    values: tuple[BoundaryValue, ...]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values)

    def __repr__(self) -> str:
        return (f"Cut({self.index}, after {self.block_name!r}, {len(self.values)} value"
                f"{'s' if len(self.values) != 1 else ''}, {format_bytes(self.nbytes)})")


def microbatch_size(program: StagedProgram, microbatches: int) -> int:
    """Samples per micro-batch for the example batch the program was compiled with."""
    return program.captured.microbatch_size(microbatches)


def cuts(program: StagedProgram, *, microbatches: int) -> tuple[Cut, ...]:
    """Every cut of `program` with its boundary values, sized for one micro-batch."""
    captured = program.captured
    sizes = captured.sizes_at(captured.microbatch_size(microbatches))
    names = captured.size_names()
    blocks = program.linear.blocks
    result = []
    for j in range(program.num_stages - 1):
        values = []
        for name, producer in program.producer.items():
            readers = program.consumers.get(name, ())
            if producer <= j and any(r > j for r in readers):
                values.append(_boundary_value(name, producer, readers, captured.values.get(name),
                                              sizes, names))
        last = program.stages[j].blocks[-1]
        result.append(Cut(j, last, blocks[last].name if last < len(blocks) else str(last),
                          tuple(values)))
    return tuple(result)


def _boundary_value(name, producer, readers, info, sizes, names) -> BoundaryValue:
    if info is None:  # not recorded (should not happen): report what is known
        return BoundaryValue(name, (), (), "?", 0, producer, tuple(readers))
    shape = tuple(int(d) if isinstance(d, int) or sympy.sympify(d).is_Integer
                  else str(sympy.sympify(d).subs(names)) for d in info.shape)
    concrete = tuple(int(evaluate(d, sizes)) for d in info.shape)
    dtype = str(info.dtype).replace("torch.", "") if info.dtype is not None else "scalar"
    return BoundaryValue(name, shape, concrete, dtype, int(evaluate(info.nbytes, sizes)),
                         producer, tuple(readers))
