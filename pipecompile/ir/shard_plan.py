"""The records of a tensor-parallel split (passes/tensor_shard.py chooses them, the runtime
holds each parameter by them: runtime/tensor_parallel.py).

    Placement(dim, parts, role)   one parameter's split over T ranks
    ShardPlan(degree, params, ...) what was split in one stage graph, and what stayed whole
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["Placement", "ShardPlan"]


@dataclass(frozen=True)
class Placement:
    """One parameter's split over T ranks: along `dim`, `parts` its fused parts' sizes (one
    part: a plain split); `role` says why ("column", "row", "column bias")."""

    dim: int
    parts: tuple[int, ...]
    role: str

    def __repr__(self) -> str:
        fused = f", parts={list(self.parts)}" if len(self.parts) > 1 else ""
        return f"Placement({self.role}, dim={self.dim}{fused})"


@dataclass(frozen=True)
class ShardPlan:
    """What `choose` decided for one stage graph at degree T."""

    degree: int
    params: Mapping[str, Placement]  # parameter name (get_attr target) -> split; others whole
    columns: tuple[str, ...] = ()  # matmul nodes split on their output features
    rows: tuple[str, ...] = ()  # matmul nodes split on their input features (reduce after)
    split: Mapping[str, int] = field(default_factory=dict)  # region node -> its split dim
    notes: tuple[str, ...] = ()  # layers left replicated, and why

    def summary(self) -> str:
        pairs = len(self.rows)
        if not self.params:
            return (f"nothing to shard at T={self.degree}: every parameter replicated"
                    + (f" ({'; '.join(self.notes)})" if self.notes else ""))
        return (f"{len(self.columns)} column- and {pairs} row-parallel matmuls, "
                f"{len(self.params)} parameters split over {self.degree}"
                + (f"; replicated: {'; '.join(self.notes)}" if self.notes else ""))
