"""The records of a tensor-parallel split (passes/tensor_shard.py chooses them, the runtime
holds each parameter by them: runtime/tensor_parallel.py).

    Placement(dim, parts, role)   one parameter's split over T ranks
    ShardPlan(degree, params, ...) what was split in one stage graph, and what stayed whole
    VocabularyLayer(...)          a table the embedding and/or output layer read, which may be
                                  split along its vocabulary (the planner prices the choice)

`ShardPlan.to_json()` / `ShardPlan.from_json(entry)`: the plan as plain JSON (a saved
tensor-parallel pipeline records each stage's, outputs/persist_tensor.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Placement", "ShardPlan", "VocabularyLayer"]


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
    embeddings: tuple[str, ...] = ()  # embedding lookups split along the vocabulary
    outputs: tuple[str, ...] = ()  # output-layer matmuls split along the vocabulary (gathered)
    vocabulary: tuple[str, ...] = ()  # each vocabulary table's priced choice, in words

    def summary(self) -> str:
        pairs = len(self.rows)
        vocab = f"; vocabulary: {'; '.join(self.vocabulary)}" if self.vocabulary else ""
        if not self.params:
            return (f"nothing to shard at T={self.degree}: every parameter replicated"
                    + (f" ({'; '.join(self.notes)})" if self.notes else "") + vocab)
        return (f"{len(self.columns)} column- and {pairs} row-parallel matmuls, "
                f"{len(self.params)} parameters split over {self.degree}" + vocab
                + (f"; replicated: {'; '.join(self.notes)}" if self.notes else ""))

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON values (`from_json` reads it back)."""
        return {"degree": self.degree,
                "params": {n: [p.dim, list(p.parts), p.role] for n, p in self.params.items()},
                "columns": list(self.columns), "rows": list(self.rows),
                "split": dict(self.split), "notes": list(self.notes),
                "embeddings": list(self.embeddings), "outputs": list(self.outputs),
                "vocabulary": list(self.vocabulary)}

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> "ShardPlan":
        """The plan `to_json` wrote."""
        return cls(int(entry["degree"]),
                   {n: Placement(int(d), tuple(int(s) for s in parts), str(role))
                    for n, (d, parts, role) in entry["params"].items()},
                   tuple(entry["columns"]), tuple(entry["rows"]),
                   {n: int(d) for n, d in entry["split"].items()}, tuple(entry["notes"]),
                   tuple(entry.get("embeddings", ())), tuple(entry.get("outputs", ())),
                   tuple(entry.get("vocabulary", ())))


@dataclass(frozen=True)
class VocabularyLayer:
    """A 2-D parameter read only by embedding lookups (rows: the vocabulary) and/or by an
    output-layer matmul (its output features: the vocabulary, the stage's output), which
    passes/tensor_shard.py can split along the vocabulary; GPT-2's tied table is read by
    both. `tokens`: rows looked up or multiplied per call; `itemsize`: bytes per element."""

    name: str
    vocab: int
    hidden: int
    roles: tuple[str, ...]  # "embedding", "output"
    tokens: int
    itemsize: int
    # split, what reads the output layer's logits: "parallel" (only a cross entropy, lowered
    # vocabulary-parallel, or nothing: never gathered) or "gathered" (all-gathered first,
    # the loss then whole on every rank)
    loss: str = "gathered"
