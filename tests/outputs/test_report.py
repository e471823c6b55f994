"""The reports: the stage table of `print(pipe)` and the pass log of `explain()`."""

from __future__ import annotations

import re

import pytest
import torch

import pipecompile as pc
from pipecompile.outputs.report import explain_passes


def _count(cell: str) -> float:
    """A count as the stage table prints it: '220', '1.60k', '2.05M'."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(cell[:-1]) * scale[cell[-1]] if cell[-1] in scale else float(cell)


def test_stage_table_values_add_up_to_the_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(),
                                torch.nn.Linear(10, 10), torch.nn.ReLU(),
                                torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    x = torch.randn(8, 10)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2,
                      loss_fn=lambda out, y: (out - y).pow(2).mean())
    lines = str(pipe).splitlines()
    rows = [re.split(r"\s{2,}", line) for line in lines[3:3 + len(pipe.program.stages)]]
    assert [row[0] for row in rows] == ["0", "1"]
    blocks = pipe.program.linear.blocks
    mb = 8 // 2
    for row, stage in zip(rows, pipe.program.stages):
        count, span = row[2].split(": ")
        assert int(count) == len(stage.blocks)
        assert span == f"{blocks[stage.blocks[0]].name} .. {blocks[stage.blocks[-1]].name}"
        linears = sum(isinstance(model[int(blocks[b].name)], torch.nn.Linear)
                      for b in stage.blocks)
        assert _count(row[4]) == pytest.approx(linears * 2 * mb * 10 * 10, rel=5e-3)
    # the parameter counts per stage sum to the model's
    assert sum(_count(row[3]) for row in rows) == sum(p.numel() for p in model.parameters())
    assert sum(int(row[2].split(":")[0]) for row in rows) == len(blocks)
    assert rows[0][7] == f"{mb * 10 * 4} B" and rows[1][7] == "-"  # one (mb, 10) float32 sent
    assert lines[-1].startswith("predicted step ")
    assert explain_passes(pipe.plan.passes) in pipe.explain()
    ran = [line.split()[0] for line in pipe.explain().splitlines()[1:] if line.strip()]
    order = ["capture", "search", "linearize", "annotate", "partition", "split"]
    assert [name for name in ran if name in order] == order


def test_the_outputs_folder_names_each_of_its_modules():
    import pipecompile.outputs as folder

    from tests.support.folders import unlisted

    assert unlisted(folder) == []
