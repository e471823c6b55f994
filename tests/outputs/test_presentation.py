"""presentation: what a pipeline shows, from its plan and a measured timeline alone, so a plan
loaded without the model shows the same stage table and pass log as the one compiled."""

from __future__ import annotations

import json

import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile.outputs import presentation


def _pipe():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, schedule="1f1b", microbatches=2,
                      loss_fn=lambda out, t: ((out - t) ** 2).mean())
    pipe.step(x, target=y)
    return pipe


def test_a_loaded_plan_shows_the_same_table_and_pass_log(tmp_path):
    pipe = _pipe()
    loaded = pc.load(pipe.save(tmp_path))
    table = presentation.describe(pipe.plan)
    assert "1f1b" in table and presentation.describe(loaded.plan) == table
    log = presentation.explain(pipe.plan).split("\n\n")[0]
    assert [r.name in log for r in pipe.plan.passes] == [True] * len(pipe.plan.passes)
    assert presentation.explain(loaded.plan).startswith(log)


def test_timelines_are_written_as_chrome_traces_and_gantt_charts(tmp_path):
    pipe = _pipe()
    measured = pipe.last_step.timeline
    path = presentation.write_chrome_trace(measured, str(tmp_path / "trace.json"))
    with open(path) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in spans) == sorted(str(e.action) for e in measured.events)
    png = presentation.plot_timeline(pipe.plan, measured, str(tmp_path / "steps.png"))
    svg = presentation.draw(pipe.plan, str(tmp_path / "cuts.svg"), backend="matplotlib")
    assert open(png, "rb").read(4) == b"\x89PNG" and "<svg" in open(svg).read()
