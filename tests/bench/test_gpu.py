"""bench/gpu.py's dry run: the one command a GPU machine runs, run here on the CPU at tiny sizes
through the same code paths, so that it keeps working between the days a GPU is lent.

One run (a module fixture, a subprocess as on the GPU machine: `PYTHONPATH=. python
bench/gpu.py OUTDIR --dry-run`); the tests read its gpu.json and gpu.md and check the values
that do not depend on the machine's speed: exactness within its bars, the preset's predictions
present and positive, the planner's memory against the runtime's accounting, compiled stages
exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ["env", "kernels", "exactness", "overhead", "preset", "memory", "tp", "compiled"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("gpu")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "bench/gpu.py", str(out), "--dry-run"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "done in" in run.stdout  # the progress lines were printed
    data = json.loads((out / "gpu.json").read_text())
    data["_md"] = (out / "gpu.md").read_text()
    return data


def _section(report: dict[str, Any], name: str) -> dict[str, Any]:
    entry = report["sections"][name]
    assert entry["status"] == "ok", (name, entry.get("error"), entry.get("traceback"))
    return entry["result"]


def test_every_section_ran_and_is_reported(report):
    assert list(report["sections"]) == SECTIONS
    for name in SECTIONS:
        _section(report, name)
        assert f"## {name}: ok" in report["_md"]
    env = _section(report, "env")
    assert env["dry_run"] is True and env["device"] == "cpu" and env["torch"]


def test_exactness_float32_and_bf16_autocast_within_their_bars(report):
    result = _section(report, "exactness")
    rows = result["rows"]
    cases = {(r["model"], r["stages"], r["schedule"]) for r in rows}
    assert cases == {("llama", 1, "gpipe"), ("llama", 2, "zb-h1"), ("gpt2", 2, "1f1b")}
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    assert len(fp32) == 3
    for row in fp32:
        assert row["ok"] and row["grad_rel_err"] <= 1e-5 and row["loss_rel_err"] <= 1e-5, row
        assert row["params_compared"] >= 20 and row["on_device"] == "cpu"
    assert result["float32_all_ok"] and result["float32_max_rel_err"] <= 1e-5
    bf16 = [r for r in rows if r["dtype"] == "bf16 autocast"]
    assert len(bf16) == 3
    for row in bf16:  # the unsplit model under the same autocast: the same bf16 arithmetic
        assert row["ok"] and row["loss_rel_err"] <= 1e-5 and row["grad_rel_err"] <= 2e-2, row
    assert result["bf16_autocast_all_ok"] and result["compile_failures"] == 0


def test_overhead_numbers_present(report):
    result = _section(report, "overhead")
    assert [r["variant"] for r in result["rows"]] == ["fp32 weights, bf16 autocast",
                                                      "bf16 weights"]
    for row in result["rows"]:
        assert row["plain_ms"] > 0 and row["pipe_ms"] > 0 and row["ratio"] > 0, row
    assert [r["devices"] for r in result["action_cost"]] == [1, 2]
    assert all(isinstance(r["us_per_action"], float) for r in result["action_cost"])


def test_preset_predictions_and_constants(report):
    result = _section(report, "preset")
    assert result["preset"].startswith("NVIDIA H100")
    assert len(result["rows"]) == 5  # the 100M model; per sequence a layer and the 2-layer model
    for row in result["rows"]:
        assert row["predicted_ms"] > 0 and isinstance(row["measured_ms"], float), row
    assert all(r["forward_gflop"] > 0 for r in result["rows"] if "forward_gflop" in r)
    assert len(result["matmul"]) == 4 and len(result["sdpa"]) == 2
    assert all(r["tflops"] > 0 for r in result["matmul"])
    names = [c["name"] for c in result["constants"]]
    assert names == ["matmul", "attention", "MEMORY_EFFICIENCY", "OP_OVERHEAD",
                     "ACTION_OVERHEAD"]
    # the overhead section's fixed cost per action reaches the preset's constants
    assert result["measured_constants"]["ACTION_OVERHEAD"] > -1


def test_memory_predicted_near_the_runtime_accounting(report):
    result = _section(report, "memory")
    per_device = [r for r in result["rows"] if r["device"] != "whole device"]
    assert [(r["stages"], r["device"]) for r in per_device] == [(1, 0), (2, 0), (2, 1)]
    for row in per_device:
        assert row["params"] > 0 and row["optim"] > 0, row
        assert 0.8 <= row["predicted_over_measured"] <= 1.25, row
    one, first, second = per_device
    assert one["optim"] >= 2 * one["params"], one  # AdamW: 2 moments of every parameter
    # split, the state is kept once: a tied weight's second holder (an alias) has none
    assert first["optim"] + second["optim"] == one["optim"], per_device


def test_compiled_stages_exact(report):
    result = _section(report, "compiled")
    assert result["exact"] is True
    assert result["compiled_grad_rel_err"] <= 1e-5 and result["eager_grad_rel_err"] <= 1e-5
    assert result["compiled_over_eager"] > 0


def test_kernels_price_every_kind_and_report_the_constants_they_imply(report):
    """Every kind of kernel price has measured rows with a positive prediction from
    kernel_prices (the CPU's times say nothing of the GPU's: only that the paths run)."""
    result = _section(report, "kernels")
    kinds = {r["kind"] for r in result["rows"] if r.get("predicted_us")}
    assert kinds == {"launch", "gemm", "attention", "memory", "loss", "optimizer"}
    for row in result["rows"]:
        assert "error" not in row, row
        if row["kind"] not in ("skipped", "attention-kernels"):  # a backward is fwd+bwd - fwd:
            assert row["predicted_us"] > 0 and row["measured_us"] == row["measured_us"], row
    gemm = [r for r in result["rows"] if r["kind"] == "gemm"]
    assert {r["case"].split()[-1] for r in gemm} == {"fwd", "dgrad", "wgrad"}
    fitted = {r["constant"]: r for r in result["fitted"]}
    assert set(fitted) == {"ceiling", "attention_forward", "attention_backward",
                           "memory_efficiency", "launch"}
    assert fitted["launch"]["measured"] > 0 and fitted["launch"]["now"] == 7e-6
    assert result["chip"] == "h100"  # no GPU name here: the H100's figures

