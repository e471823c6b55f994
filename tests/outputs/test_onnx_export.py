"""export.py on a split program (tests/outputs/test_onnx_run.py exports compiled zoo models): the
manifest names the stages' values and the model's parameter names, a tied weight is listed and
written into each file that reads it, and chaining the files computes the model in eval mode."""

from __future__ import annotations

import json

import numpy as np
import onnx
import torch

from pipecompile.capture.capture import capture
from pipecompile.outputs.onnx_export import export_onnx
from pipecompile.outputs.onnx_run import run
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split


class _TiedLM(torch.nn.Module):
    """Embedding and head share one weight; dropout in between (the identity in eval mode)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.body = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.drop(torch.tanh(self.body(self.embed(ids)))))


def test_stage_files_chain_to_the_model_in_eval_mode(tmp_path):
    torch.manual_seed(0)
    model = _TiedLM()
    ids = torch.randint(0, 11, (4, 5))
    linear = linearize(capture(model, (ids,)), granularity="layer")
    program = split(linear, (0, 2, linear.num_blocks), ["cpu", "cpu"])
    path = export_onnx(program, tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert path == str(tmp_path / "manifest.json")
    assert manifest["inputs"] == ["ids"] and manifest["dynamic_batch"] is True
    assert [s["file"] for s in manifest["stages"]] == ["stage0.onnx", "stage1.onnx"]
    first, second = manifest["stages"]
    assert first["outputs"] == list(program.stages[0].outputs)
    assert set(second["inputs"]) == set(program.stages[1].inputs)
    assert second["outputs"] == manifest["outputs"]
    # the tie: one weight under two names, written into both stage files
    assert manifest["tied"] == [["embed.weight", "head.weight"]]
    tie = {"embed.weight", "head.weight"}
    held = [set(s["parameters"].values()) for s in manifest["stages"]]
    assert held[0] - tie == {"body.weight", "body.bias"} and held[0] & tie  # embedding + body
    assert held[1] & tie and not held[1] - tie  # the head: the tied weight only
    for stage in manifest["stages"]:
        graph = onnx.load(str(tmp_path / stage["file"])).graph
        assert set(stage["parameters"]) <= {init.name for init in graph.initializer}
    # another batch size: dim 0 stays symbolic in the files
    model.eval()
    other = torch.randint(0, 11, (3, 5))
    (out,) = run(path, {"ids": other.numpy()})
    with torch.no_grad():
        want = model(other).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
