"""ONNX export: chaining the stage files through onnxruntime equals the model in eval mode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import pipecompile as pc
import pipecompile.outputs.onnx_run as pco
from tests.support.models import CASES
from tests.passes.test_eval_mode import DropoutMLP

# transformers models: ~4-8 s each to compile and export two stages
SLOW = {"gpt2", "bert", "llama", "t5", "vit"}
_EXPORTED: dict[str, tuple] = {}


def _f32(value):
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _exported(name: str, tmp_path_factory) -> tuple:
    """(pipe, manifest path, float32 model in eval mode, args, kwargs), exported once per run."""
    if name not in _EXPORTED:
        torch.manual_seed(0)
        case = CASES[name]()
        model = case.model.float()
        args = tuple(_f32(a) for a in case.args)
        kwargs = {k: _f32(v) for k, v in case.kwargs.items()}
        pipe = pc.compile(model, args, kwargs, devices=2, microbatches=2)
        manifest = pipe.export_onnx(tmp_path_factory.mktemp(name))
        model.eval()
        _EXPORTED[name] = (pipe, manifest, model, args, kwargs)
    return _EXPORTED[name]


def _run_both(pipe, manifest, model, args, kwargs):
    flat = pipe.program.captured.flatten_inputs(args, kwargs)
    got = pco.run(manifest, [x.numpy() for x in flat if isinstance(x, torch.Tensor)])
    with torch.no_grad():
        want = [t.numpy() for t in torch.utils._pytree.tree_leaves(model(*args, **kwargs))]
    return got, want


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
    for n in sorted(CASES)
])
def test_onnx_chain_equals_model_in_eval_mode(name, tmp_path_factory):
    pipe, manifest, model, args, kwargs = _exported(name, tmp_path_factory)
    got, want = _run_both(pipe, manifest, model, args, kwargs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.abs(g - w).max() <= 1e-4

    directory = Path(manifest).parent
    data = json.loads(Path(manifest).read_text())
    assert [s["file"] for s in data["stages"]] == ["stage0.onnx", "stage1.onnx"]
    for entry, stage in zip(data["stages"], pipe.program.stages):
        model_proto = onnx.load(str(directory / entry["file"]))
        onnx.checker.check_model(model_proto)
        assert [v.name for v in model_proto.graph.input] == entry["inputs"]
        assert [v.name for v in model_proto.graph.output] == entry["outputs"]
        # initializers keep the model's names
        assert set(entry["parameters"].values()) <= set(stage.parameter_names)
        assert set(entry["parameters"]) <= {i.name for i in model_proto.graph.initializer}


def test_manifest_format_names_and_ties(tmp_path_factory):
    pipe, manifest, *_ = _exported("gpt", tmp_path_factory)
    data = json.loads(Path(manifest).read_text())
    pco.validate_manifest(data)
    assert data["inputs"] == ["idx"]
    assert data["outputs"] == list(pipe.program.captured.output_names)
    assert data["stages"][0]["outputs"] == list(pipe.program.stages[0].outputs)
    assert data["stages"][1]["inputs"] == list(pipe.program.stages[1].inputs)
    assert data["tied"] == [["wte.weight", "lm_head.weight"]]
    every = set()
    for stage in data["stages"]:
        every |= set(stage["parameters"].values())
    # every parameter is in some file, under the name its stage reads it by (a model name)
    assert every == {n for s in pipe.program.stages for n in s.parameter_names}
    assert every | {"wte.weight"} >= {n for n, _ in pipe.named_parameters()}


def test_dynamic_batch_runs_other_batch_sizes(tmp_path_factory):
    pipe, manifest, model, _, _ = _exported("gpt", tmp_path_factory)
    assert json.loads(Path(manifest).read_text())["dynamic_batch"] is True
    first = onnx.load(str(Path(manifest).parent / "stage0.onnx"))
    assert first.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic
    chain = pco.Chain(manifest)
    for batch in (1, 3, 13):
        x = torch.randint(0, 64, (batch, 8))
        got = chain({"idx": x.numpy()})
        with torch.no_grad():
            want = model(x).numpy()
        assert got[0].shape == want.shape
        assert np.abs(got[0] - want).max() <= 1e-4


def test_static_capture_and_dropout(tmp_path):
    """torch.fx capture (static shapes, nn.Dropout and F.dropout): exported in eval mode."""
    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(8, 6)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, capture="fx")
    manifest = pipe.export_onnx(tmp_path)
    model.eval()
    got, want = _run_both(pipe, manifest, model, (x,), {})
    assert np.abs(got[0] - want[0]).max() <= 1e-5


def test_validate_manifest_names_the_problem():
    good = {"inputs": ["x"], "outputs": ["y"],
            "stages": [{"file": "stage0.onnx", "inputs": ["x"], "outputs": ["h"]},
                       {"file": "stage1.onnx", "inputs": ["h", "x"], "outputs": ["y"]}]}
    pco.validate_manifest(good)
    with pytest.raises(pc.ConfigError, match=r"\$: missing key 'stages'"):
        pco.validate_manifest({"inputs": [], "outputs": ["y"]})
    with pytest.raises(pc.ConfigError, match=r"\$.stages\[0\].file: expected string"):
        pco.validate_manifest({**good, "stages": [{**good["stages"][0], "file": 3}]})
    with pytest.raises(pc.ConfigError, match=r"'h' is neither a model input"):
        pco.validate_manifest({**good, "stages": good["stages"][1:]})
    with pytest.raises(pc.ConfigError, match=r"'z' is produced by no stage"):
        pco.validate_manifest({**good, "outputs": ["z"]})
    with pytest.raises(pc.ConfigError, match=r"\$.outputs: \[\] should be non-empty"):
        pco.validate_manifest({**good, "outputs": []})  # the schema's every keyword holds
    schema = json.loads(pco.SCHEMA_PATH.read_text())
    for key in schema["required"]:  # every key the schema requires is enforced by name
        with pytest.raises(pc.ConfigError, match=rf"\$: missing key '{key}'"):
            pco.validate_manifest({k: v for k, v in good.items() if k != key})


def test_run_checks_its_inputs(tmp_path_factory):
    _, manifest, *_ = _exported("gpt", tmp_path_factory)
    with pytest.raises(pc.ConfigError, match="the manifest takes 1"):
        pco.run(manifest, [np.zeros((2, 8), np.int64)] * 2)
    with pytest.raises(pc.ConfigError, match=r"inputs \['idx'\] are missing"):
        pco.run(manifest, {"x": np.zeros((2, 8), np.int64)})
