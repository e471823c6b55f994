"""A meta model is traced on fakes that claim its stage device, then gets its own tensors back."""

import pytest
import torch

from pipecompile.capture.capture import capture
from pipecompile.capture.claimed_device import claimable, claiming, restore_tensors


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight  # tied: one fake, one tensor back
        self.register_buffer("scale", torch.ones(3), persistent=False)

    def forward(self, x):
        h = self.a(x)
        if h.device.type == "cpu":
            h = h + 1
        return self.b(h) * self.scale + torch.zeros(x.shape[0], 3, device=x.device)


def _meta_model():
    with torch.device("meta"):
        return _Branchy()


def test_claimable_takes_only_devices_this_torch_can_fake():
    assert claimable(["cpu", "cpu"]) == torch.device("cpu")
    expected = torch.device("cuda:1") if torch.cuda.is_available() else torch.device("cpu")
    assert claimable(["cuda:1", "cpu"]) == expected
    if not torch.cuda.is_available():  # a fake CUDA tensor would abort this process
        assert claimable(["cuda:0"]) is None


def test_the_traced_graph_takes_the_claimed_devices_branch_and_holds_the_models_tensors():
    model = _meta_model()
    own = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    x = torch.randn(4, 3)
    with claiming(model, ((x,), {}), torch.device("cpu")) as ((args, kwargs), originals):
        assert model.a.weight.device == torch.device("cpu") and not model.a.weight.is_meta
        assert model.a.weight is model.b.weight
        captured = capture(model, args, kwargs)
    captured = restore_tensors(captured, model, originals, torch.device("cpu"))
    assert captured.traced_device == torch.device("cpu")
    # the model has its own meta tensors back
    assert all(t is own[n] for n, t in list(model.named_parameters()) + list(model.named_buffers()))
    held = dict(captured.module.named_parameters(remove_duplicate=False))
    held.update(captured.module.named_buffers(remove_duplicate=False))
    assert held and all(t.is_meta and type(t) in (torch.Tensor, torch.nn.Parameter)
                        for t in held.values())
    assert held["a.weight"] is own["a.weight"]
    targets = [str(n.target) for n in captured.module.graph.nodes if n.op == "call_function"]
    assert sum("add" in t for t in targets) == 2  # h + 1 (the cpu branch) and + zeros
    devices = {v for n in captured.module.graph.nodes for v in n.kwargs.values()
               if isinstance(v, torch.device)}
    assert devices == {torch.device("cpu")}


def test_the_model_gets_its_tensors_back_when_capture_fails():
    model = _meta_model()
    weight = model.a.weight
    with pytest.raises(RuntimeError, match="inside"):
        with claiming(model, (torch.randn(2, 3),), torch.device("cpu")):
            raise RuntimeError("inside")
    assert model.a.weight is weight and model.b.weight is weight
