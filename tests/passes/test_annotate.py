"""passes/annotate: symbolic block costs against FLOPs and saved tensors counted on real layers."""

from __future__ import annotations

import pytest
import sympy
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from pipecompile.capture.capture import capture
from pipecompile.ir.records import evaluate
from pipecompile.passes.annotate import (
    DeviceModel,
    annotate,
    optimizer_state_factor,
    symbolic_block_costs,
    with_measured_times,
)
from pipecompile.passes.linearize import linearize


class Chain(nn.Module):
    """Linear(16, 64) -> Linear(64, 32) -> Linear(32, 32) x 2: one block per layer."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 64), nn.Linear(64, 32),
                                     nn.Linear(32, 32), nn.Linear(32, 32)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    captured = capture(Chain(), (torch.randn(8, 16),), {})
    assert captured.batch_symbol is not None
    return linearize(captured)


def _counted(layer: nn.Linear, batch: int) -> tuple[int, int, int, int]:
    """(forward, input-grad, weight-grad FLOPs, saved non-parameter bytes) of `layer` run for
    real on a batch whose input needs a gradient, as torch counts them."""
    x = torch.randn(batch, layer.in_features, requires_grad=True)
    params = {id(p) for p in layer.parameters()}
    saved = []

    def pack(t):
        if id(t) not in params and id(t._base) not in params:
            saved.append(t.numel() * t.element_size())
        return t

    # the layer's own function: FlopCounterMode's module hooks break autograd.grad on a leaf
    with FlopCounterMode(display=False) as counter:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = nn.functional.linear(x, layer.weight, layer.bias)
        forward = counter.get_total_flops()
        torch.autograd.grad(out, [x], torch.ones_like(out), retain_graph=True)
        after_input = counter.get_total_flops()
        torch.autograd.grad(out, list(layer.parameters()), torch.ones_like(out))
        after_weight = counter.get_total_flops()
    return forward, after_input - forward, after_weight - after_input, sum(saved)


def test_linear_forward_flops_are_2_b_in_out_in_the_batch_symbol(linear):
    b = linear.captured.batch_symbol
    costs = symbolic_block_costs(linear)
    assert sympy.expand(costs[1].forward_flops - 2 * b * 64 * 32) == 0
    assert costs[1].forward_flops.free_symbols == {b}
    layer = nn.Linear(64, 32)
    for batch in (1, 4, 7):
        forward, *_ = _counted(layer, batch)
        assert evaluate(costs[1].forward_flops, {b: batch}) == forward == 2 * batch * 64 * 32


def test_backward_flops_split_into_input_and_weight_gradients(linear):
    b = linear.captured.batch_symbol
    costs = symbolic_block_costs(linear)
    _, input_grad, weight_grad, _ = _counted(nn.Linear(64, 32), 5)
    assert evaluate(costs[1].backward_input_flops, {b: 5}) == input_grad == 2 * 5 * 64 * 32
    assert evaluate(costs[1].backward_weight_flops, {b: 5}) == weight_grad == 2 * 5 * 64 * 32
    # the first block reads the model input, which needs no gradient: its backward is W only
    assert costs[0].backward_input_flops == 0
    assert sympy.expand(costs[0].backward_weight_flops - 2 * b * 16 * 64) == 0


def test_activation_bytes_are_the_saved_inputs_without_parameters(linear):
    b = linear.captured.batch_symbol
    costs = symbolic_block_costs(linear)
    *_, saved = _counted(nn.Linear(64, 32), 3)
    assert evaluate(costs[1].activation_bytes, {b: 3}) == saved == 3 * 64 * 4  # float32 input
    assert sympy.expand(costs[0].activation_bytes - 16 * 4 * b) == 0
    assert sympy.expand(costs[1].io_bytes - 32 * 4 * b) == 0  # the block's output


def test_parameter_counts_and_bytes(linear):
    costs = symbolic_block_costs(linear, optimizer_factor=2.0)
    assert [c.param_count for c in costs] == [16 * 64 + 64, 64 * 32 + 32, 32 * 32 + 32,
                                              32 * 32 + 32]
    assert sum(c.param_count for c in costs) == sum(p.numel() for p in Chain().parameters())
    assert costs[1].param_bytes == costs[1].grad_bytes == 4 * (64 * 32 + 32)
    assert costs[1].optimizer_bytes == 2 * costs[1].param_bytes
    assert costs[1].parameters == ("layers.1.weight", "layers.1.bias")


def test_repeated_layers_cost_the_same(linear):
    costs = symbolic_block_costs(linear)
    fields = ("forward_flops", "backward_input_flops", "backward_weight_flops",
              "activation_bytes", "io_bytes", "param_count")
    assert [getattr(costs[2], f) for f in fields] == [getattr(costs[3], f) for f in fields]
    assert costs[2].parameters != costs[3].parameters


def test_annotate_evaluates_at_the_microbatch_size(linear):
    device = DeviceModel(flops=1e9, bandwidth=1e8, op_overhead=1e-6)
    table = annotate(linear, microbatch_size=4, device=device, optimizer_factor=1.0)
    block = table.blocks[1]
    assert block.forward_flops == 2 * 4 * 64 * 32
    assert block.backward_flops == 2 * (2 * 4 * 64 * 32)
    assert block.forward_time == pytest.approx(2 * 4 * 64 * 32 / 1e9 + 4 * 32 * 4 / 1e8 + 1e-6)
    # backward: input and weight gradients share twice forward's traffic by their FLOPs
    assert block.backward_input_time == pytest.approx(block.backward_weight_time)
    assert block.static_bytes == 3 * 4 * (64 * 32 + 32)  # parameters, gradients, momentum
    assert block.activation_bytes == 4 * 64 * 4
    # cut k carries block k-1's output: (mb, 64), (mb, 32), (mb, 32) in float32
    assert table.cut_bytes == (0, 4 * 64 * 4, 4 * 32 * 4, 4 * 32 * 4, 0)
    measured = with_measured_times(table, {1: (1.0, 2.0, 3.0)})
    assert (measured.blocks[1].forward_time, measured.blocks[1].backward_input_time,
            measured.blocks[1].backward_weight_time, measured.blocks[1].measured) == (
                1.0, 2.0, 3.0, True)
    assert measured.blocks[0] == table.blocks[0] and table.blocks[1].measured is False


@pytest.mark.parametrize("optimizer, factor", [
    (None, 0.0),
    (lambda p: torch.optim.SGD(p, lr=0.1), 0.0),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1.0),
    (lambda p: torch.optim.AdamW(p), 2.0),
])
def test_optimizer_state_factor(optimizer, factor):
    assert optimizer_state_factor(optimizer) == factor


def test_symbolic_costs_are_computed_once_per_graph_and_shapes(monkeypatch):
    """A second capture of an equal model (a new instance) reuses the costs kept in the
    cache; other parameter shapes or an optimizer factor compute them anew."""
    import pipecompile.passes.annotate as annotate_module
    from pipecompile.ir.compile_cache import CompileCache

    calls = []
    compute = annotate_module._symbolic_block_costs
    cache = CompileCache(maxsize=3)
    monkeypatch.setattr(annotate_module, "_symbolic_block_costs",
                        lambda *args: calls.append(1) or compute(*args))

    def costs(model, factor=0.0):
        return symbolic_block_costs(linearize(capture(model, (torch.randn(8, 16),), {})),
                                    optimizer_factor=factor, cache=cache)

    first = costs(Chain())
    assert costs(Chain()) == first and len(calls) == 1
    wider = Chain()
    wider.layers[1] = nn.Linear(64, 48)
    wider.layers[2] = nn.Linear(48, 32)
    assert costs(wider) != first and len(calls) == 2
    assert costs(Chain(), factor=2.0) != first and len(calls) == 3
    costs(Chain(), factor=3.0)  # a bounded cache: the least recently used goes
    assert len(calls) == 4 and len(cache) == 3
    assert costs(Chain()) == first and len(calls) == 5  # the first entry was evicted


class MasterWeightsAdamW(torch.optim.Optimizer):
    """Adam over fp32 master weights and moments of 16-bit parameters, kept in its state (as
    Megatron-LM's mixed-precision optimizer keeps them)."""

    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["master"] = p.detach().float()
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                g = p.grad.float()
                state["exp_avg"].lerp_(g, 0.1)
                state["exp_avg_sq"].mul_(0.999).addcmul_(g, g, value=0.001)
                state["master"].addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt() + 1e-8,
                                         value=-group["lr"])
                p.copy_(state["master"])


def test_the_state_factor_is_probed_in_the_models_dtype():
    """On a bf16 probe, torch's AdamW keeps bf16 moments (2 bytes of state per parameter
    byte); an optimizer keeping fp32 master weights and moments keeps 12 bytes per 2-byte
    parameter: 6 (an fp32 probe would have said 3)."""
    adamw = lambda p: torch.optim.AdamW(p)  # noqa: E731
    assert optimizer_state_factor(adamw, torch.bfloat16) == 2.0
    assert optimizer_state_factor(MasterWeightsAdamW, torch.bfloat16) == 6.0
    assert optimizer_state_factor(MasterWeightsAdamW) == 3.0
