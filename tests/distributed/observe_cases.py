"""Run on every gloo rank by tests/outputs/test_trace.py (importable by the spawned processes):
a profiled step, the job's metrics and its one chrome trace."""

from __future__ import annotations

import json
from collections import Counter

import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.schedule.actions import COMPUTE_KINDS
from tests.support.ranges import pp_range


def observed_step(rank, path):
    """Two steps of a 2-stage GPT; the second profiled; metrics, the trace (rank 0 reads it)."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=16, layers=4, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, schedule="1f1b",
                      loss_fn=zoo.lm_loss, timeout=300)
    pipe.step(x, target=x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = pipe.step(x, target=x)
    events = prof.events()
    ranges = Counter(e.name for e in events if e.name.startswith("PP:"))
    forward_ops = Counter(pp_range(e) for e in events if e.name == "aten::addmm")
    metrics = pipe.metrics()
    pipe.write_chrome_trace(path)
    timeline = pipe.timeline()
    busy = sum(e.duration for e in timeline.events if e.action.kind in COMPUTE_KINDS)
    return {"loss": loss.item(), "ranges": dict(ranges), "forward_ops": dict(forward_ops),
            "row": [str(a) for a in pipe.schedule.actions[rank]], "metrics": metrics,
            "busy": busy, "span": timeline.makespan,
            "trace": json.load(open(path)) if rank == 0 else None}
