"""One Chrome trace for the job: every device's actions, and an arrow from each send to its
receive (Chrome trace-event JSON: chrome://tracing and Perfetto open it).

    pipe.step(x, target=y)
    pipe.write_chrome_trace("step.json")   # under torchrun: every rank calls it, rank 0 writes

Layout: a process (pid) per rank, named ``rank r`` (one process: pid 0), a thread (tid) per
pipeline device, named ``device d``; each action a complete event (``ph: "X"``) named by its
text (``1F3``, ``0SEND_F3>1``), in microseconds. A flow (``ph: "s"`` at the send, ``ph: "f"``
at its receive, one id per message) joins ``sSEND_Xi>p`` to ``pRECV_Xi<s``, across threads
and ranks.

Clocks. Each rank's events count from its own step start (`StepResult.started`, its
`time.perf_counter()`), and ranks' counters share no origin. Rank 0 measures each rank's
offset: after each of a few barriers every rank reads its counter, and the offset is the
median of the differences to rank 0's readings (a barrier releases the ranks within the
latency of one message, so the error is about that). Events are placed on rank 0's clock;
the trace starts at the earliest event.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Sequence

from ..runtime.spec import StepResult
from ..schedule.actions import Action, Kind

__all__ = ["chrome_trace", "rows_of", "write_job_trace", "Row"]

# one rank's events: (device, action text, start, end) on that rank's clock, in seconds
Row = tuple[int, str, float, float]

_SENDS = {Kind.SEND_F: Kind.RECV_F, Kind.SEND_B: Kind.RECV_B}
_ROUNDS = 5  # barriers measuring the clock offsets


def chrome_trace(ranks: Sequence[Sequence[Row]], offsets: Sequence[float] | None = None, *,
                 pipeline_size: int | None = None) -> dict[str, Any]:
    """The trace of `ranks` (each rank's rows; one process: one rank), each rank's clock minus
    its offset (seconds, from rank 0's; None: all zero). Ranks r and r' run one pipeline when
    r // pipeline_size == r' // pipeline_size (data-parallel replicas: messages stay within)."""
    size = pipeline_size or len(ranks)
    offsets = list(offsets) if offsets is not None else [0.0] * len(ranks)
    placed = [(r, d, text, start - offsets[r], end - offsets[r])
              for r, rows in enumerate(ranks) for d, text, start, end in rows]
    origin = min((p[3] for p in placed), default=0.0)
    trace: list[dict[str, Any]] = []
    for r, rows in enumerate(ranks):
        if len(ranks) > 1:
            trace.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name":
                                                                                  f"rank {r}"}})
        for d in sorted({row[0] for row in rows}):
            trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": d,
                          "args": {"name": f"device {d}"}})
    at: dict[tuple[int, Action], tuple[int, int, float, float]] = {}
    for r, d, text, start, end in placed:
        action = Action.parse(text)
        at[r // size, action] = (r, d, (start - origin) * 1e6, (end - origin) * 1e6)
        trace.append({"name": text, "cat": action.kind.value, "ph": "X", "pid": r, "tid": d,
                      "ts": (start - origin) * 1e6, "dur": (end - start) * 1e6,
                      "args": {"stage": action.stage, "microbatch": action.microbatch}})
    flow = 0
    for (replica, action), (r, d, start, end) in list(at.items()):
        if action.kind not in _SENDS or action.peer is None:
            continue
        match = Action(action.peer, _SENDS[action.kind], action.microbatch, action.stage)
        if (replica, match) not in at:
            continue
        rr, rd, rstart, rend = at[replica, match]
        name = f"{action} -> {match}"
        trace.append({"name": name, "cat": "message", "ph": "s", "id": flow, "pid": r,
                      "tid": d, "ts": (start + end) / 2})
        trace.append({"name": name, "cat": "message", "ph": "f", "bp": "e", "id": flow,
                      "pid": rr, "tid": rd, "ts": (rstart + rend) / 2})
        flow += 1
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def rows_of(result: StepResult) -> list[Row]:
    """A step's events as rows on this process's clock."""
    return [(e.device, str(e.action), result.started + e.start, result.started + e.end)
            for e in result.events]


def write_job_trace(result: StepResult, path: str, *, distributed: bool,
                    pipeline_size: int | None = None) -> str:
    """Write the job's trace of `result` at `path` (under torch.distributed a collective: every
    rank calls it, rank 0 gathers and writes); returns the path."""
    rows = rows_of(result)
    if not distributed:
        return _write(chrome_trace([rows]), path)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    readings = []
    for _ in range(_ROUNDS):
        dist.barrier()
        readings.append(time.perf_counter())
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((rows, readings), gathered if rank == 0 else None, dst=0)
    if rank == 0:
        base = gathered[0][1]
        offsets = [statistics.median(t - b for t, b in zip(theirs, base))
                   for _, theirs in gathered]
        _write(chrome_trace([g[0] for g in gathered], offsets, pipeline_size=pipeline_size),
               path)
    dist.barrier()  # the file exists when any rank returns
    return path


def _write(trace: dict[str, Any], path: str) -> str:
    with open(path, "w") as f:
        json.dump(trace, f)
    return path
