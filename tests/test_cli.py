"""The `pipecompile` command: `python -m pipecompile` in a subprocess (its entry point, exit
status and streams), and the same `main()` in-process where a test compiles (no interpreter and
torch import per test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipecompile.cli import main

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = str(ROOT / "examples" / "factories.py")


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipecompile", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, timeout=900)


def _main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
          *args: str) -> subprocess.CompletedProcess:
    """main(args) run from the repository's root as the console script runs it: its status,
    stdout and stderr as `_run` returns them."""
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pipecompile", *args], status, out, err)


def test_inspect_json_with_code_and_drawing(tmp_path, capsys, monkeypatch):
    done = _main(capsys, monkeypatch, "inspect", f"{FACTORIES}:keyword_tuple", "--devices", "3",
                 "--microbatches", "2", "--code", "--runtime", "--draw",
                 str(tmp_path / "partition.svg"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # stdout is only the JSON object
    assert [s["index"] for s in result["stages"]] == [0, 1, 2]
    assert len(result["cuts"]) == 2
    cut = result["cuts"][0]
    assert len(cut["values"]) == 2  # the residual stream and the last layer's linear output
    for value in cut["values"]:
        assert value["shape"] == ["batch", 8] and value["microbatch_shape"] == [4, 8]
        assert value["dtype"] == "float32" and value["bytes"] == 4 * 8 * 4
        assert value["producer"] == 0 and value["consumers"] == [1]
    assert cut["bytes"] == 2 * 4 * 8 * 4
    assert "def forward(self, x" in result["code"]["0"]
    assert "aten_linear_default(" in result["code"]["0"]  # the direct calls training runs
    assert sorted(result["runtime_code"]) == ["0", "1", "2"]
    assert "def device_1(" in result["runtime_code"]["1"]
    assert "1F0: stage 1, forward of micro-batch 0" in result["runtime_code"]["1"]
    assert 0 < result["predicted"]["bubble_fraction"] < 1
    assert (tmp_path / "partition.svg").read_text().lstrip().startswith("<?xml")
    assert "pipecompile: compiling KeywordTupleModel for 3 devices" in done.stderr  # progress


@pytest.mark.slow
def test_inspect_gpt2_text(capsys, monkeypatch):
    done = _main(capsys, monkeypatch, "inspect", "examples/factories.py:gpt2", "--devices", "4",
                 "--schedule", "gpipe", "--microbatches", "4")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("Pipeline: 4 stages, schedule gpipe, 4 micro-batches")
    assert "cuts (tensors sent between stages, per micro-batch):" in out
    for j in range(3):
        assert f"cut {j} (stage {j} | {j + 1}" in out
    assert "[batch, 32, 64]  = (2, 32, 64)  float32  16.00 KiB" in out  # the batch symbolic


def test_plan_prints_the_schedule_and_draws_the_prediction(tmp_path, capsys):
    # in-process (the same main() as the console script) to keep the suite fast
    status = main(["plan", f"{FACTORIES}:keyword_tuple", "--devices", "2", "--schedule", "1f1b",
                   "--microbatches", "4", "--gantt", str(tmp_path / "gantt.png")])
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "1f1b: 2 stages on 2 devices, 4 micro-batches"
    assert lines[2].startswith("dev 0") and "0F0" in lines[2]
    assert any(line.startswith("predicted step time") for line in lines)
    assert any(line.startswith("bubble") for line in lines)
    assert "peak in-flight micro-batches per stage: 0: 2, 1: 1" in out
    assert (tmp_path / "gantt.png").read_bytes()[:4] == b"\x89PNG"
    status = main(["plan", f"{FACTORIES}:keyword_tuple", "--devices", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    chosen = result["search"]["candidates"][0]  # --schedule and --microbatches are "auto"
    assert chosen["reason"] == "" and chosen["step"] > 0  # the winner: no reason it lost
    assert result["schedule"]["name"] == chosen["schedule"] and len(result["peak_inflight"]) == 2


def test_export_onnx_and_save_then_use_both(tmp_path, capsys, monkeypatch):
    done = _main(capsys, monkeypatch, "export", f"{FACTORIES}:keyword_tuple", "--devices", "2",
                 "--microbatches", "2", "--onnx", str(tmp_path / "onnx"),
                 "--save", str(tmp_path / "saved"), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result == {"onnx": str(tmp_path / "onnx" / "manifest.json"),
                      "save": str(tmp_path / "saved" / "plan.json")}
    assert "exporting stage 2 of 2 to ONNX" in done.stderr

    import pipecompile
    import pipecompile.outputs.onnx_run

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from factories import keyword_tuple
    finally:
        sys.path.pop(0)
    model, (x,), kwargs = keyword_tuple()
    model.eval()
    with torch.no_grad():
        want = model(x, **kwargs)
    got = pipecompile.outputs.onnx_run.run(result["onnx"], {"x": x.numpy(), "scale": kwargs["scale"].numpy()})
    for g, w in zip(got, want, strict=True):
        assert np.abs(g - w.numpy()).max() <= 1e-5
    with torch.no_grad():
        loaded = pipecompile.load(tmp_path / "saved")(x, **kwargs)
    for g, w in zip(loaded, want, strict=True):
        torch.testing.assert_close(g, w)


def test_bad_path_is_a_one_line_error_with_status_2():
    done = _run("inspect", "missing.py:gpt")
    assert done.returncode == 2
    assert done.stderr.strip() == "pipecompile: error: missing.py: no such file"
    assert done.stdout == ""


@pytest.mark.parametrize("target, message", [
    (f"{FACTORIES}:nope", "has no function 'nope'; functions there: gpt, gpt2, keyword_tuple"),
    ("examples/factories.py", "is not FILE.py:FACTORY"),
    ("bad.py:not_a_pair", "not_a_pair() returned Linear; return (model, example_inputs)"),
    ("bad.py:fails", "fails() raised RuntimeError: no weights here"),
])
def test_bad_factories_are_one_line_errors(target, message, tmp_path, capsys, monkeypatch):
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "def not_a_pair():\n    return torch.nn.Linear(2, 2)\n"
        "def fails():\n    raise RuntimeError('no weights here')\n")
    monkeypatch.chdir(tmp_path if target.startswith("bad.py") else ROOT)
    assert main(["inspect", target]) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], captured.err
    assert captured.out == ""


def test_export_needs_a_destination(capsys):
    assert main(["export", f"{FACTORIES}:gpt"]) == 2
    assert "export needs --onnx DIR and/or --save DIR" in capsys.readouterr().err


def test_plan_a_cluster_searches_the_layout(capsys):
    status = main(["plan", "examples/factories.py:gpt", "--device", "h100", "--nodes", "2",
                   "--per-node", "2", "--global-batch", "8", "--json"])
    assert status == 0
    result = json.loads(capsys.readouterr().out)
    layout = result["layout"]
    assert layout["pipeline"] * layout["data_parallel"] == 4
    assert result["search"]["layouts"][0]["pipeline"] == layout["pipeline"]
    assert main(["plan", "examples/factories.py:gpt", "--nodes", "2"]) == 2
    assert "give --device NAME too" in capsys.readouterr().err
