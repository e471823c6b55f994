"""compile's `devices` option: one device name is one device; a name torch does not know is a
ConfigError naming it (not torch's "Expected one of cpu, cuda, ... device string")."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_one_device_name_is_one_device(device):
    model = _model()
    x = torch.randn(4, 4)
    pipe = pc.compile(model, (x,), devices=device, microbatches=2)
    listed = pc.compile(model, (x,), devices=[device], microbatches=2)
    assert [str(s.device) for s in pipe.stages] == [str(s.device) for s in listed.stages] == ["cpu"]
    with torch.no_grad():
        assert torch.equal(pipe(x), model(x))


def test_one_device_name_plans_lazily_too():
    model = _model()
    pipe = pc.compile(model, devices="cpu")
    x = torch.randn(4, 4)
    with torch.no_grad():
        assert torch.equal(pipe(x), model(x))
    assert [str(s.device) for s in pipe.stages] == ["cpu"]


@pytest.mark.parametrize("devices", ["gpu", ["cpu", "tpu9"]])
def test_a_name_that_is_no_device_is_refused_by_name(devices):
    bad = devices if isinstance(devices, str) else devices[1]
    with pytest.raises(pc.ConfigError, match=rf"devices holds '{bad}', which is not a torch "
                                             rf"device; give a count"):
        pc.compile(_model(), (torch.randn(4, 4),), devices=devices, microbatches=2)
