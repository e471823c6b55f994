"""resolution.py: `explain()` ends with the request beside what the passes resolved."""

from __future__ import annotations

from dataclasses import replace

import torch

import pipecompile as pc
from pipecompile.ir.compile_cache import CompileCache
from pipecompile.outputs.resolution import explain_resolution


def test_asked_beside_resolved_one_row_per_resolved_value():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    pipe = pc.compile(model, (torch.randn(4, 4),), devices=["cpu", "cpu"], schedule="1f1b",
                      checkpoint=False, cache=CompileCache())
    r = pipe.plan.resolved
    lines = explain_resolution(pipe.plan).splitlines()
    assert [line.split()[0] for line in lines] == [
        "option", "layout", "tensor_parallel", "devices", "topology", "schedule",
        "microbatches", "virtual", "recomputation"]
    rows = {line[:16].strip(): line[16:].split("  ")[0].strip() for line in lines[1:]}
    assert rows == {"layout": "data_parallel=None, fsdp=False", "tensor_parallel": "1",
                    "devices": "['cpu', 'cpu']",
                    "topology": "-", "schedule": "'1f1b'", "microbatches": "'auto'",
                    "virtual stages": "'auto'", "recomputation": "False"}
    assert lines[5].endswith("  1f1b") and lines[6].endswith(f"  {r.microbatches}")
    assert lines[3].endswith("  cpu, cpu") and lines[4].endswith("  one process")
    assert lines[2].endswith("  1")  # no tensor parallelism
    assert lines[1].endswith("  2 pipeline x 1 replica(s)")
    assert pipe.explain().endswith("\n\n" + "\n".join(lines))
    loaded = explain_resolution(replace(pipe.plan, request=None)).splitlines()
    assert all("(loaded plan)" in line for line in loaded[1:])
