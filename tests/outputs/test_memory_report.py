"""memory_report.py: the per-device table of measured and predicted bytes, and the measured
parameters, gradients and optimizer state counted from the tensors themselves
(tests/integration/test_memory_stats.py checks the activation peaks through `pipe.memory_stats()`)."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile.outputs.memory_report import DeviceMemory, device_memory, format_memory


def test_table_rows_and_ratio():
    kib = DeviceMemory(0, "cpu", (0, 2), parameters=4096, gradients=4096, optimizer_state=8192,
                       activations=1536, total=17920, microbatch_activations=768,
                       predicted_total=20000.0, predicted_static=16384.0,
                       predicted_activations=3616.0)
    loaded = DeviceMemory(1, "cpu", (1,), 2_000_000, 0, 0, 0, 2_000_000, 0)  # no prediction
    assert kib.ratio == 20000 / 17920 and loaded.ratio is None
    assert format_memory((kib, loaded)).splitlines() == [
        "device  stages    params     grads     optim     activ      total  pred activ  "
        "pred total  pred/meas",
        "0 cpu      0,2  4.00 KiB  4.00 KiB  8.00 KiB  1.50 KiB  17.50 KiB    3.54 KiB   "
        "19.54 KiB       1.12",
        "1 cpu        1  1.91 MiB       0 B       0 B       0 B   1.91 MiB           -      "
        "     -          -"]
    assert str(loaded) == format_memory((loaded,))


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def test_measured_bytes_are_the_stage_tensors_and_the_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=torch.nn.functional.mse_loss)
    adam = torch.optim.Adam(pipe.parameters())
    pipe.step(x, target=y)
    adam.step()
    report = device_memory(pipe.runtime, pipe.plan, [adam])
    assert [d.stages for d in report] == [(0,), (1,)]
    for d in report:
        params = list(pipe.runtime.program.stages[d.stages[0]].module.parameters())
        assert d.parameters == _nbytes(params)
        assert d.gradients == _nbytes(p.grad for p in params)
        # Adam keeps two tensors of each parameter's size and a step count per parameter
        state = [t for p in params for t in adam.state[p].values()]
        assert d.optimizer_state == _nbytes(state) >= 2 * d.parameters
        assert d.total == d.parameters + d.gradients + d.optimizer_state + d.activations
        assert d.activations > 0 and d.predicted_total is not None
    # wherever the plan cut, the devices together hold every parameter once
    assert sum(d.parameters for d in report) == _nbytes(model.parameters())
