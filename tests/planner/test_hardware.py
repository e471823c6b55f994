"""Planning for hardware that is not here: absolute `DeviceSpec`s, the presets of
pipecompile.planner.hardware, analytic compiles that measure nothing, and `pipecompile plan --device`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import pipecompile as pc
from pipecompile.planner import decisions, model_passes, shape_passes
from pipecompile import cli, zoo
from pipecompile.errors import ConfigError
from pipecompile.planner.hardware import preset
from pipecompile.planner.options import device_present, require_present
from pipecompile.ir.devices import DeviceSpec
from pipecompile.passes.partition import PartitionProblem, stage_time
from pipecompile.schedule.messages import transfer_seconds

FACTORIES = str(Path(__file__).resolve().parents[2] / "examples" / "factories.py")
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


# -- presets and validation --------------------------------------------------------------------

def test_presets_carry_the_datasheet_figures_at_the_stated_fractions():
    h100 = preset("h100")
    assert h100 == preset("H100") == preset("NVIDIA H100 80GB SXM") == preset("h100-sxm5-80gb")
    assert (h100.name, h100.memory, h100.latency) == ("cuda", 80e9, 10e-6)
    # the median GEMM of published layers as measured on an H200 (the same GH100): 0.71 of the
    # dense BF16 peak 989.4 (half the sparse 1979)
    assert h100.flops == pytest.approx(0.71 * 989.4e12)
    assert h100.rate("bfloat16") == h100.flops
    assert h100.rate("float32") == pytest.approx(0.71 * 66.9e12)
    assert preset("a100").flops == pytest.approx(267.9e12 * 0.71 / (792.1 / 989.4))
    assert h100.bandwidth == pytest.approx(0.8 * 450e9)  # NVLink 4: 900 GB/s both ways
    # eager memory-bound kernels: FlashAttention's standard attention, 40.3 GB in 41.7 ms on a
    # 1.555 TB/s A100 (0.62 of HBM), assumed for the H100 too
    assert h100.memory_bandwidth == pytest.approx(40.3e9 / 41.7e-3 / 1555e9 * 3.35e12)
    assert h100.memory_bandwidth == pytest.approx(0.6215 * 3.35e12, rel=1e-3)
    assert h100.op_overhead == pytest.approx(7e-6)  # an eager op back to back on the H200
    a100 = preset("A100", link="infiniband", efficiency=0.4)
    assert a100.flops == pytest.approx(0.4 * 312e12)
    assert a100.rate("float32") == pytest.approx(0.4 * 19.5e12)
    assert (a100.bandwidth, a100.latency) == (pytest.approx(0.8 * 25e9), 20e-6)  # HDR 200 Gb/s
    assert a100.absolute and not DeviceSpec().absolute


def test_preset_errors_name_what_exists():
    with pytest.raises(ConfigError, match="no device preset named 'v100'; presets: h100, a100, h200"):
        preset("v100")
    with pytest.raises(ConfigError, match="has no link 'pcie'; use one of nvlink, infiniband"):
        preset("h100", link="pcie")
    with pytest.raises(ConfigError, match=r"efficiency must be in \(0, 1\]"):
        preset("h100", efficiency=1.5)


@pytest.mark.parametrize("fields, message", [
    (dict(flops=0.0), "flops must be > 0, got 0.0"),
    (dict(flops=-1e12), "flops must be > 0"),
    (dict(flops=1e12, latency=-1e-6), "latency must be >= 0"),
    (dict(flops=1e12, dtype_flops=(("bfloat16", 0.0),)), r"dtype_flops\['bfloat16'\] must be > 0"),
    (dict(flops=1e12, action_overhead=-1.0), "action_overhead must be >= 0"),
    (dict(memory_bandwidth=1e12), "describe an absolute device; give flops="),
])
def test_spec_validation_names_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        DeviceSpec("cuda", **fields)


def test_a_message_costs_latency_on_top_of_its_bytes():
    spec = DeviceSpec(bandwidth=1e9, latency=1e-5)
    assert spec.send_time(0) == 0.0
    assert spec.send_time(2e9) == pytest.approx(2.0 + 1e-5)
    assert transfer_seconds({(0, 1, "F"): 10**9}, 1e9, latency=1e-5) == {
        (0, 1, "F"): pytest.approx(1.0 + 1e-5)}
    # a stage pays one latency per message: the activations out and the gradients back in
    problem = PartitionProblem(block_times=(1.0, 1.0), cut_bytes=(0.0, 1e9, 0.0),
                               static_bytes=(0.0, 0.0), activation_bytes=(0.0, 0.0),
                               devices=(spec, spec), inflight=(2, 1))
    assert stage_time(problem, 0, 0, 1) == pytest.approx(1.0 + 1.0 + 1e-5)


# -- compile without measuring -----------------------------------------------------------------

@pytest.fixture
def nothing_measured(monkeypatch):
    """Every way compile could time this machine raises."""
    def measured(*args, **kwargs):
        raise AssertionError("an analytic compile measured this machine")

    for module, name in ((decisions, "matmul_rate"), (decisions, "action_overhead"),
                         (shape_passes, "probe"), (model_passes, "measure"),
                         (model_passes, "efficiency")):
        monkeypatch.setattr(module, name, measured)


def _gpt():
    torch.manual_seed(0)
    return zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8), torch.randint(0, 64, (4, 8))


def test_a_described_device_predicts_flops_over_its_rate(nothing_measured):
    model, x = _gpt()
    with FlopCounterMode(display=False) as counter:  # the reference: torch counts eagerly
        model(x).pow(2).mean().backward()
    model.zero_grad()
    rate = 2e12
    spec = DeviceSpec("cuda", flops=rate)  # no memory traffic, op or action costs, free links
    pipe = pc.compile(model, (x,), devices=[spec, spec], loss_fn=lambda o, y: o.pow(2).mean(),
                      schedule="gpipe", microbatches=1, checkpoint=False)
    # gpipe with one micro-batch runs F0 F1 B1 B0 one after another: the whole step's FLOPs.
    # Attention runs fused (FlashAttention): QK^T and PV are 4 b h s^2 d FLOPs, half of them
    # under the causal mask, and its backward 2.5x that; torch's eager count on this CPU has
    # none for attention (its CPU flash kernel is not in FlopCounterMode's table)
    attention = 4 * 4 * 2 * 8 * 8 * 8 * 4  # b=4, h=2, s=8, d=8; 4 layers
    expected = counter.get_total_flops() + (1 + 2.5) * attention / 2
    assert pipe.predicted.makespan == pytest.approx(expected / rate, rel=1e-9)


def test_two_presets_plan_without_measuring_and_say_so(nothing_measured):
    model, x = _gpt()
    h100 = preset("h100")
    pipe = pc.compile(model, (x,), devices=[h100, h100], loss_fn=lambda o, y: o.pow(2).mean())
    flops = sum(b.forward_flops + b.backward_flops for b in pipe.plan.costs.blocks)
    m = pipe.plan.resolved.microbatches
    assert pipe.predicted.makespan >= m * flops / (2 * h100.rate("float32"))  # fp32 model
    explained = pipe.explain()
    assert "costs analytic for 2 x NVIDIA H100 80GB SXM (0.71 of peak, nvlink)" in explained
    assert "float32 at 47.5 TFLOP/s" in explained and "nothing measured" in explained
    assert "predicted step" in str(pipe) and "KiB (" in str(pipe)  # each stage's memory


def test_heterogeneous_presets_get_relative_speeds_at_the_models_dtype():
    model, x = _gpt()
    model = model.to(torch.bfloat16)
    pipe = pc.compile(model, (x,), devices=[preset("h100"), preset("a100")], schedule="gpipe",
                      microbatches=2, checkpoint=False)
    speeds = [d.speed for d in pipe.plan.resolved.devices]
    assert speeds == [1.0, pytest.approx(267.9 / 792.1)]  # each one's GEMM rate
    assert pipe.plan.device_model.flops == pytest.approx(0.71 * 989.4e12)  # bfloat16 rate


def test_described_and_measured_devices_do_not_mix():
    model, x = _gpt()
    with pytest.raises(ConfigError, match=r"device 1 \('cpu'\) without"):
        pc.compile(model, (x,), devices=[preset("h100"), "cpu"])


@NO_CUDA
def test_stages_of_an_absent_device_stay_with_the_model_and_cannot_run():
    model, x = _gpt()
    pipe = pc.compile(model, (x,), devices=[preset("h100")] * 2, schedule="1f1b",
                      microbatches=2, checkpoint=False)
    assert not device_present("cuda") and device_present("cpu")
    assert {str(s.device) for s in pipe.program.stages} == {"cpu"}  # the model's device
    with pytest.raises(ConfigError, match=r"pipe.step\(\): this plan is for 2 x NVIDIA H100"):
        require_present(pipe.plan.resolved.devices, where="pipe.step()")


# -- the command line --------------------------------------------------------------------------

def test_cli_plans_a_meta_llama_for_h100s(capsys):
    status = cli.main(["plan", f"{FACTORIES}:llama3_70b", "--arg", "layers=2", "--arg", "seq=64",
                       "--arg", "batch=4", "--devices", "2", "--device", "h100",
                       "--optimizer", "adamw"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "cuda (absent; on meta)" in out  # planned for CUDA, kept on meta
    assert "costs analytic for 2 x NVIDIA H100 80GB SXM" in out and "bfloat16" in out
    assert "predicted step" in out and "GiB (" in out  # the stage table's memory column
    assert "plan:" in out  # explain(): the search's verdict


def test_cli_rejects_a_bad_factory_argument(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", f"{FACTORIES}:gpt", "--arg", "layers"])
    assert "is not KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["plan", f"{FACTORIES}:gpt", "--arg", "nope=1", "--device", "h100"]) == 2
    assert "gpt(nope=1) raised TypeError" in capsys.readouterr().err



def test_the_h200_preset_is_the_h100_chip_with_its_memory_and_bandwidth():
    """NVIDIA's H200 datasheet: the H100's GH100 (same dense peaks) with 141 GB at 4.8 TB/s."""
    h100, h200 = preset("h100"), preset("NVIDIA H200")
    assert h200.memory == 141e9 and h100.memory == 80e9
    assert h200.flops == h100.flops
    assert h200.memory_bandwidth == pytest.approx(h100.memory_bandwidth * 4800 / 3350)
