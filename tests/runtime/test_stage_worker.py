"""runtime/stage_worker: one stage's forward and backward equal autograd on the module itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from pipecompile.runtime.stage_worker import LossSpec, StageWorker
from pipecompile.runtime.versions import VersionRule, WeightVersions

# The CUDA branch of the random-state handling runs wherever a GPU is present.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Middle(nn.Module):
    """A stage that reads a received value `h` and a model input `x`, and returns two values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.skip = nn.Linear(2, 3, bias=False)

    def forward(self, h, x):
        y = torch.tanh(self.fc(h))
        return y, y * self.skip(x)


class Dropped(nn.Module):
    """Dropout between two layers: its mask must be the same when the forward is recomputed."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, h):
        return (self.fc2(F.dropout(torch.relu(self.fc1(h)), p=0.5, training=True)),)


def _middle_worker(module, **options) -> StageWorker:
    return StageWorker(0, module, ("h", "x"), ("y", "z"), frozenset({"h"}), **options)


def _grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _inputs(mb: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(mb)
    inputs = {"h": torch.randn(6, 4, generator=g, dtype=torch.float64),
              "x": torch.randn(6, 2, generator=g, dtype=torch.float64)}
    grads = {"y": torch.randn(6, 3, generator=g, dtype=torch.float64),
             "z": torch.randn(6, 3, generator=g, dtype=torch.float64)}
    return inputs, grads


def _autograd(module, microbatches) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Input gradients of `h` per micro-batch and accumulated parameter gradients."""
    module.zero_grad(set_to_none=True)
    input_grads = []
    for mb in microbatches:
        inputs, grads = _inputs(mb)
        h = inputs["h"].clone().requires_grad_(True)
        y, z = module(h, inputs["x"])
        torch.autograd.backward([y, z], [grads["y"], grads["z"]])
        input_grads.append(h.grad)
    return input_grads, _grads(module)


def test_forward_backward_equal_autograd_on_the_module():
    torch.manual_seed(0)
    module = Middle().double()
    want_inputs, want_params = _autograd(module, [0, 1])
    module.zero_grad(set_to_none=True)
    worker = _middle_worker(module)
    outputs = {mb: worker.forward(mb, _inputs(mb)[0]) for mb in (0, 1)}
    assert sorted(outputs[0]) == ["y", "z"]
    y, z = module(*_inputs(0)[0].values())
    torch.testing.assert_close(outputs[0]["y"], y, rtol=0, atol=0)
    torch.testing.assert_close(outputs[0]["z"], z, rtol=0, atol=0)
    assert worker.peak_inflight == 2
    got = [worker.backward(mb, _inputs(mb)[1]) for mb in (0, 1)]
    assert [sorted(g) for g in got] == [["h"], ["h"]]  # x is a model input: no gradient sent
    for mb in (0, 1):
        torch.testing.assert_close(got[mb]["h"], want_inputs[mb], rtol=1e-14, atol=0)
    for name, grad in _grads(module).items():
        torch.testing.assert_close(grad, want_params[name], rtol=1e-14, atol=0)
    assert worker.saved == {}  # backward frees the micro-batch


def test_zero_bubble_i_then_w_equals_b():
    torch.manual_seed(0)
    module = Middle().double()
    want_inputs, want_params = _autograd(module, [0, 1])
    module.zero_grad(set_to_none=True)
    worker = _middle_worker(module)
    for mb in (0, 1):
        worker.forward(mb, _inputs(mb)[0])
    got = [worker.backward_input(mb, _inputs(mb)[1]) for mb in (0, 1)]  # I0 I1, then W0 W1
    assert all(p.grad is None for p in module.parameters())  # I computes no weight gradient
    for mb in (0, 1):
        torch.testing.assert_close(got[mb]["h"], want_inputs[mb], rtol=1e-14, atol=0)
    worker.backward_weight(0)
    worker.backward_weight(1)
    for name, grad in _grads(module).items():
        torch.testing.assert_close(grad, want_params[name], rtol=1e-14, atol=0)
    assert worker.saved == {}


def test_last_stage_loss_is_scaled_and_its_gradient_exact():
    torch.manual_seed(0)
    module = Middle().double()
    target = torch.randn(6, 3, dtype=torch.float64)
    spec = LossSpec(unflatten=lambda outs: outs[1], loss_fn=F.mse_loss, scale=0.25)
    worker = _middle_worker(module, loss=spec)
    inputs, _ = _inputs(0)
    worker.forward(0, inputs, target)
    got = worker.backward(0, {})
    params = _grads(module)

    module.zero_grad(set_to_none=True)
    h = inputs["h"].clone().requires_grad_(True)
    loss = F.mse_loss(module(h, inputs["x"])[1], target)
    torch.testing.assert_close(worker.losses[0], loss.detach(), rtol=0, atol=0)
    (0.25 * loss).backward()
    torch.testing.assert_close(got["h"], h.grad, rtol=1e-14, atol=0)
    for name, grad in _grads(module).items():
        torch.testing.assert_close(params[name], grad, rtol=1e-14, atol=0)


def _dropout_run(device: str, *, checkpoint: bool, seed: int = 123) -> tuple:
    """1F1B order F0 F1 B0 F2 B1 B2 on one stage: input grads, parameter grads, outputs and
    the random state after the last backward."""
    torch.manual_seed(0)
    module = Dropped().double().to(device)
    worker = StageWorker(0, module, ("h",), ("out",), frozenset({"h"}), checkpoint=checkpoint)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(8, 5, generator=g, dtype=torch.float64).to(device) for _ in range(3)]
    grads = [torch.randn(8, 5, generator=g, dtype=torch.float64).to(device) for _ in range(3)]
    torch.manual_seed(seed)
    if device != "cpu":
        torch.cuda.manual_seed_all(seed)
    outputs, input_grads = {}, {}
    for kind, mb in (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)):
        if kind == "F":
            outputs[mb] = worker.forward(mb, {"h": inputs[mb]})["out"]
        else:
            input_grads[mb] = worker.backward(mb, {"out": grads[mb]})["h"]
    generator = torch.cuda.get_rng_state(0) if device != "cpu" else torch.get_rng_state()
    return ([input_grads[mb] for mb in range(3)], _grads(module),
            torch.stack([outputs[mb] for mb in range(3)]), generator)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpointed_dropout_recomputes_the_forward_masks(device):
    plain_inputs, plain_params, plain_out, plain_rng = _dropout_run(device, checkpoint=False)
    inputs, params, out, rng = _dropout_run(device, checkpoint=True)
    other_seed = _dropout_run(device, checkpoint=False, seed=124)[0]
    assert not torch.allclose(other_seed[0], plain_inputs[0])  # the masks matter
    assert torch.equal(out, plain_out)
    for got, want in zip(inputs, plain_inputs):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    for name, grad in params.items():
        torch.testing.assert_close(grad, plain_params[name], rtol=1e-14, atol=0)
    # recomputation put the random state back: the next draw is the one it would have been
    assert torch.equal(rng, plain_rng)


def test_checkpointed_backward_keeps_stashed_weights_and_target():
    """Checkpointing with a weight version: the recompute uses the version the forward saw."""
    torch.manual_seed(0)
    module = Middle().double()
    spec = LossSpec(unflatten=lambda outs: outs[0], loss_fn=F.mse_loss, scale=1.0)
    rule = VersionRule("pipedream", stages=2, stage=1, microbatches=2)
    versions = WeightVersions(module, rule, lambda p: torch.optim.SGD(p, lr=0.5))
    versions.begin_call()
    worker = _middle_worker(module, loss=spec, checkpoint=True, versions=versions)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    inputs, _ = _inputs(0)
    target = torch.zeros(6, 3, dtype=torch.float64)
    worker.forward(0, inputs, target)
    with torch.no_grad():  # the live weights move before the backward runs
        for p in module.parameters():
            p.add_(1.0)
    got = worker.backward(0, {})

    reference = Middle().double()
    reference.load_state_dict(before)
    h = inputs["h"].clone().requires_grad_(True)
    F.mse_loss(reference(h, inputs["x"])[0], target).backward()
    torch.testing.assert_close(got["h"], h.grad, rtol=1e-14, atol=0)
    assert sorted(versions.pending) == ["fc.bias", "fc.weight"]  # skip does not reach the loss
    for name, grad in versions.pending.items():
        torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad,
                                   rtol=1e-14, atol=0)


class _Hooks:
    """Data-parallel gradient hooks as the worker calls them."""

    def begin_step(self) -> None:
        pass

    def before_backward(self) -> None:
        pass


@pytest.mark.parametrize("options, names", [
    ({}, ("KeptForward", "FusedBackward")),
    ({"checkpoint": True}, ("RecomputedForward", "FusedBackward")),
    ({"split_weights": True}, ("KeptForward", "SplitBackward")),
    ({"split_weights": True, "fused_backward": True}, ("KeptForward", "CompiledBackward")),
    ({"checkpoint": True, "sync": "hooks"}, ("RecomputedForward", "FusedBackward", "_Hooks")),
])
def test_the_options_choose_the_behaviours_once(options, names):
    if "sync" in options:
        options = {**options, "sync": _Hooks()}
    worker = _middle_worker(Middle().double(), **options)
    assert worker.behaviours == names
    chosen = (worker.forward_behaviour, worker.backward_behaviour)
    worker.forward(0, _inputs(0)[0])  # running does not choose again
    assert (worker.forward_behaviour, worker.backward_behaviour) == chosen
    assert repr(worker) == f"StageWorker(0, {', '.join(names)})"


def test_weight_versions_choose_the_versioned_backward():
    module = Middle().double()
    rule = VersionRule("pipedream", 1, 0, 1)
    worker = _middle_worker(module, versions=WeightVersions(
        module, rule, lambda ps: torch.optim.SGD(ps, lr=0.1)))
    assert worker.behaviours == ("KeptForward", "VersionedBackward")
    worker.split_weights = True  # an option changed later chooses again, from all of them
    assert worker.behaviours == ("KeptForward", "VersionedBackward")
