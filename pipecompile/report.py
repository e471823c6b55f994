"""Human-readable reports: the stage table printed by `print(pipe)`, the pass log of
`pipe.explain()`, and the number formats every report uses.

They read plan data (the staged program, the schedule, the predicted timeline, pass records),
never a `Pipeline`, so a saved or loaded plan prints the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .passes.split import StagedProgram
    from .search import SearchResult
    from .plan import PassRecord
    from .runtime.actions import Schedule
    from .runtime.simulate import Timeline

__all__ = ["stage_table", "explain_passes", "explain_search", "format_count", "format_bytes"]


def format_count(x: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (decimal prefixes, for parameters and FLOPs)."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def format_bytes(n: float) -> str:
    """4096 -> '4.0 KiB' (binary prefixes, for memory and message sizes)."""
    for factor, suffix in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= factor:
            return f"{n / factor:.1f} {suffix}"
    return f"{n:.0f} B"


def stage_table(program: "StagedProgram", schedule: "Schedule", *, microbatches: int,
                predicted: "Timeline | None") -> str:
    """One row per stage: blocks, parameters, FLOPs, predicted time and memory, boundary."""
    blocks = program.linear.blocks
    captured = program.captured
    head = (f"Pipeline: {program.num_stages} stages, schedule {schedule.name}, "
            f"{microbatches} micro-batches, capture {captured.method}"
            f"{' (dynamic batch)' if captured.dynamic_batch else ' (static shapes)'}")
    rows = [("stage", "device", "blocks", "params", "fwd FLOP/mb", "F+B ms/mb",
             "memory", "sends/mb")]
    for stage in program.stages:
        first, last = blocks[stage.blocks[0]].name, blocks[stage.blocks[-1]].name
        span = first if first == last else f"{first} .. {last}"
        c = stage.cost
        if c is None:
            rows.append((str(stage.index), str(stage.device), f"{len(stage.blocks)}: {span}",
                         "-", "-", "-", "-", "-"))
            continue
        rows.append((str(stage.index), str(stage.device), f"{c.num_blocks}: {span}",
                     format_count(c.params), format_count(c.forward_flops),
                     f"{(c.forward_time + c.backward_time) * 1e3:.3f}",
                     f"{format_bytes(c.memory)} ({c.inflight} mb)",
                     format_bytes(c.send_bytes) if stage.index < program.num_stages - 1 else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [head]
    for k, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if predicted is not None:
        lines.append(f"predicted step {predicted.makespan * 1e3:.2f} ms, "
                     f"bubble {predicted.bubble_fraction:.1%}")
    return "\n".join(lines)


def explain_passes(records: Sequence["PassRecord"]) -> str:
    """The pass log: one line per pass with its wall time and what it produced."""
    lines = ["pass          time     result"]
    for r in records:
        lines.append(f"{r.name:<12} {r.seconds * 1e3:7.1f} ms  {r.summary}")
    return "\n".join(lines)


def explain_search(search: "SearchResult | None", *, top: int = 8) -> str:
    """The plan the search chose, its best `top` candidates and why the others lost, and the
    winner's gap to a lower bound (all compute spread over the devices: no bubble, no overhead)."""
    if search is None:
        return ("plan: nothing searched (schedule, micro-batches, virtual stages and checkpoint "
                "were all given explicitly, or the plan was loaded)")
    best = search.best
    gap = best.step / search.lower_bound - 1 if search.lower_bound > 0 else 0.0
    lines = [f"plan: {best.schedule}, {best.microbatches} micro-batches, {best.virtual_stages} "
             f"virtual stage(s), recompute stages {list(best.recomputed) or 'none'}; predicted "
             f"step {best.step * 1e3:.3f} ms, {gap:.1%} above the lower bound "
             f"{search.lower_bound * 1e3:.3f} ms (compute / devices, no bubble, no overhead)",
             f"searched {', '.join(search.searched)}: {len(search.candidates)} candidates"
             + (f", the best {top}:" if len(search.candidates) > top else ":")]
    rows = [("schedule", "m", "v", "recompute", "step ms", "peak memory per device", "verdict")]
    for c in search.candidates[:top]:
        rows.append((c.schedule, str(c.microbatches), str(c.virtual_stages),
                     ",".join(map(str, c.recomputed)) or "-",
                     f"{c.step * 1e3:.3f}" if c.fits else "-",
                     " ".join(format_bytes(m) for m in c.memory) or "-",
                     c.reason or "chosen"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)
