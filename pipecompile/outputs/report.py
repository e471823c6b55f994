"""Human-readable reports: the stage table printed by `print(pipe)`, the pass log of
`pipe.explain()`, and the layouts the search weighed (number formats: `ir/formats.py`).

They read plan data (the staged program, the schedule, the predicted timeline, pass records),
never a `Pipeline`, so a saved or loaded plan prints the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..ir.formats import format_bytes, format_count, format_stages
from .table import format_table

if TYPE_CHECKING:
    from ..ir.devices import DeviceSpec
    from ..ir.records import StagedProgram
    from ..planner.schedule_search import SearchResult
    from ..planner.plan import PassRecord
    from ..schedule.actions import Schedule
    from ..schedule.simulate import Timeline

__all__ = ["stage_table", "explain_passes", "explain_search", "explain_layouts"]


def _memory(per_device: Sequence[float], *, limit: int = 8) -> str:
    """Each device's bytes, or with more than `limit` devices the fullest and the emptiest."""
    if len(per_device) <= limit:
        return " ".join(format_bytes(m) for m in per_device)
    top = max(range(len(per_device)), key=lambda d: per_device[d])
    low = min(range(len(per_device)), key=lambda d: per_device[d])
    return (f"max {format_bytes(per_device[top])} (device {top}), min "
            f"{format_bytes(per_device[low])} (device {low})")


def stage_table(program: "StagedProgram", schedule: "Schedule", *, microbatches: int,
                predicted: "Timeline | None", specs: "Sequence[DeviceSpec] | None" = None) -> str:
    """One row per stage: blocks, parameters, FLOPs, predicted time and memory, boundary.
    With `specs` (the plan's `stage_specs`), a stage planned for a device this machine lacks
    shows both: "cuda (absent; on meta)"."""
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
        device = str(stage.device)
        planned = specs[stage.index].name if specs is not None else device
        if planned != device:  # planned for a device that is not here (see options)
            device = f"{planned} (absent; on {device})"
        if c is None:
            rows.append((str(stage.index), device, f"{len(stage.blocks)}: {span}",
                         "-", "-", "-", "-", "-"))
            continue
        rows.append((str(stage.index), device, f"{c.num_blocks}: {span}",
                     format_count(c.params), format_count(c.forward_flops),
                     f"{(c.forward_time + c.backward_time) * 1e3:.3f}",
                     f"{format_bytes(c.memory)} ({c.inflight} mb)",
                     format_bytes(c.send_bytes) if stage.index < program.num_stages - 1 else "-"))
    lines = [head, *format_table(rows, header=True)]
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
    winner's gap to a lower bound (all compute spread over what can run at once: the devices,
    or the cores their threads share; no bubble, no overhead), saying what it assumes."""
    if search is None:
        return ("plan: nothing searched (schedule, micro-batches, virtual stages and checkpoint "
                "were all given explicitly, or the plan was loaded)")
    best = search.best
    gap = best.step / search.lower_bound - 1 if search.lower_bound > 0 else 0.0
    recomputed = format_stages(best.recomputed) if best.recomputed else "none"
    lines = [f"plan: {best.schedule}, {best.microbatches} micro-batches, {best.virtual_stages} "
             f"virtual stage(s), recompute stages {recomputed}; predicted "
             f"step {best.step * 1e3:.3f} ms, {gap:.1%} above the lower bound "
             f"{search.lower_bound * 1e3:.3f} ms ({search.bound_note})",
             f"searched {', '.join(search.searched)}: {len(search.candidates)} candidates"
             + (f", the best {top}:" if len(search.candidates) > top else ":")]
    rows = [("schedule", "m", "v", "recompute", "step ms", "peak memory per device", "verdict")]
    for c in search.candidates[:top]:
        rows.append((c.schedule, str(c.microbatches), str(c.virtual_stages),
                     format_stages(c.recomputed)[1:-1] or "-",
                     f"{c.step * 1e3:.3f}" if c.fits else "-",
                     _memory(c.memory) or "-",
                     c.reason or "chosen"))
    lines += format_table(rows, header=True, indent=2)
    if len(best.memory) > 8:  # the table shows only the extremes: every device of the winner
        cells = [f"{d}: {format_bytes(m)}" for d, m in enumerate(best.memory)]
        lines.append("chosen plan's peak memory per device:")
        lines += ["  " + ", ".join(cells[i:i + 8]) for i in range(0, len(cells), 8)]
    return "\n".join(lines)


def explain_layouts(layouts: Sequence[Any], *, top: int = 10) -> str:
    """The layouts (P x D, FSDP, what stays inside a node) the search compared: each one's
    best plan, predicted step and fullest device, and why it lost (`LayoutCandidate`s, the
    winner first)."""
    lines = [f"layouts compared: {len(layouts)}" + (f", the best {top}:" if len(layouts) > top
                                                     else ":")]
    rows = [("P x D x T", "sharding", "inside a node", "plan", "step ms", "max memory", "verdict")]
    for c in layouts[:top]:
        lay = c.layout
        plan = (f"{c.schedule} m={c.microbatches} v={c.virtual_stages}"
                + (f" recompute {c.recomputed}" if c.recomputed else "")) if c.fits else "-"
        rows.append((f"{lay.pipeline} x {lay.data_parallel} x {lay.tensor_parallel}"
                     + ("+SP" if lay.sequence_parallel else ""),
                     "FSDP" if lay.fsdp else "replicated" if lay.data_parallel > 1 else "-",
                     lay.inner if lay.pipeline > 1 and lay.data_parallel > 1 else "-", plan,
                     f"{c.step * 1e3:.1f}" if c.fits else "-",
                     format_bytes(c.memory) if c.fits else "-", c.reason or "chosen"))
    lines += format_table(rows, header=True, indent=2)
    bound = [c for c in layouts if "tensor parallelism" in c.reason]
    if bound:
        lines.append(f"{len(bound)} layout(s) bound by tensor parallelism (a stage does not "
                     f"fit at their T)")
    return "\n".join(lines)
