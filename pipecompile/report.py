"""Human-readable reports: the stage table printed by `print(pipe)` and the pass log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .pipeline import PassRecord, Pipeline

__all__ = ["StageCost", "stage_table", "explain_passes", "format_count"]


@dataclass(frozen=True)
class StageCost:
    """Predicted cost of one stage per micro-batch (from the cost model)."""

    num_blocks: int
    params: int
    forward_flops: float
    forward_time: float
    backward_time: float
    memory: float  # params + grads + optimizer state + activations of in-flight micro-batches
    inflight: int
    send_bytes: float  # boundary bytes after this stage


def format_count(x: float, unit: str = "") -> str:
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def _bytes(x: float) -> str:
    for factor, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(x) >= factor:
            return f"{x / factor:.1f} {suffix}"
    return f"{x:.0f} B"


def stage_table(pipe: "Pipeline") -> str:
    """One row per stage: blocks, parameters, FLOPs, predicted time and memory, boundary."""
    program = pipe.program
    blocks = program.linear.blocks
    head = (f"Pipeline: {program.num_stages} stages, schedule {pipe.schedule.name}, "
            f"{pipe.microbatches} micro-batches, capture {program.captured.method}"
            f"{' (dynamic batch)' if program.captured.dynamic_batch else ' (static shapes)'}")
    rows = [("stage", "device", "blocks", "params", "fwd FLOP/mb", "F+B ms/mb",
             "memory", "sends/mb")]
    for stage in program.stages:
        c: StageCost = stage.cost
        first, last = blocks[stage.blocks[0]].name, blocks[stage.blocks[-1]].name
        span = first if first == last else f"{first} .. {last}"
        rows.append((str(stage.index), str(stage.device), f"{c.num_blocks}: {span}",
                     format_count(c.params), format_count(c.forward_flops),
                     f"{(c.forward_time + c.backward_time) * 1e3:.3f}",
                     f"{_bytes(c.memory)} ({c.inflight} mb)",
                     _bytes(c.send_bytes) if stage.index < program.num_stages - 1 else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head]
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if pipe.predicted is not None:
        t = pipe.predicted
        lines.append(f"predicted step {t.makespan * 1e3:.2f} ms, bubble {t.bubble_fraction:.1%}")
    return "\n".join(lines)


def explain_passes(records: Sequence["PassRecord"]) -> str:
    lines = ["pass          time     result"]
    for r in records:
        lines.append(f"{r.name:<12} {r.seconds * 1e3:7.1f} ms  {r.summary}")
    return "\n".join(lines)
