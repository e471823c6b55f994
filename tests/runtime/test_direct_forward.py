"""The direct forward of a stage graph (runtime/direct_forward.py) runs the same ATen ops in
the same order as the GraphModule's own forward, with bitwise the same values and gradients,
on real architectures and on a module using every op whose binding is chosen by name; it
follows the live parameters and is emitted again when the graph's owners change."""

from __future__ import annotations

import copy
import linecache
import pickle
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import pipecompile as pc
from pipecompile.capture.capture import capture
from pipecompile.runtime.direct_forward import DirectCalls, direct_forward
from pipecompile.runtime.op_binding import _RESOLVED, binding, direct_call, schema_arguments

from tests.support.models import bert, gpt, gpt2, llama, residual_cnn, t5, unet, vit
from tests.support.reference import assert_grads_equal, reference_step


class _Ops(TorchDispatchMode):
    """Records every ATen op dispatched below autograd, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _run(graph: torch.fx.GraphModule, fn, args) -> tuple[list, list, list[str]]:
    """Outputs, gradients (inputs, then parameters) and the dispatched ops of fn(*args) and
    a backward from the sum of its squared float outputs."""
    args = [a.detach().requires_grad_() if a.is_floating_point() else a for a in args]
    with _Ops() as ops:
        out = [o for o in fn(*args) if isinstance(o, torch.Tensor)]
        loss = sum(o.double().pow(2).sum() for o in out if o.is_floating_point())
        wrt = [a for a in args if a.requires_grad] + list(graph.parameters())
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return out, list(grads), ops.ops


def _same(graph: torch.fx.GraphModule, args) -> None:
    """The direct forward dispatches the graph's ops and gives its values, bit for bit."""
    direct = direct_forward(graph, "test")
    assert direct is not None
    torch.manual_seed(0)
    out0, grads0, ops0 = _run(graph, graph, args)
    torch.manual_seed(0)
    out1, grads1, ops1 = _run(graph, direct.fn, args)
    assert ops0 == ops1 and len(ops0) > 0
    assert len(out0) == len(out1) > 0
    assert all(torch.equal(a, b) for a, b in zip(out0, out1))
    assert sum(g is not None for g in grads0) > 0
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads0, grads1))


@pytest.mark.parametrize("case", [gpt, gpt2, llama, bert, t5, vit, unet, residual_cnn])
def test_same_ops_values_and_gradients_on_real_models(case) -> None:
    torch.manual_seed(0)
    c = case()
    captured = capture(c.model, c.args, c.kwargs)
    _same(captured.module, captured.flatten_inputs(c.args, c.kwargs))


class _EveryOp(nn.Module):
    """Uses the ops whose Python binding is picked by name (`_RESOLVED`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a, b, c = h.split(2, dim=-1)
        t = torch.cat([(a + b) * c - a / (b.abs() + 1), a, c], dim=1)
        t = t.transpose(0, 1).transpose(0, 1).reshape(x.shape[0], 2, 3).view(x.shape[0], 6)
        s = t.softmax(-1) + t.log_softmax(-1) + t.pow(2)
        m = s.mean(dim=1, keepdim=True) + s.sum(dim=1, keepdim=True)
        w = torch.where(s > 0, s, m).masked_fill(s < -1, 0.5)
        q = w.unsqueeze(1).squeeze(1).flatten(0, 1).view(x.shape[0], 6)
        r = torch.arange(6, dtype=q.dtype) + torch.arange(1, 7, dtype=q.dtype) \
            + torch.arange(0, 12, 2, dtype=q.dtype)
        f = torch.full((6,), 2.0) + torch.zeros(6) + torch.ones(6)
        top = q.max(dim=1).values.unsqueeze(1)
        parts = torch.cat(list(q.chunk(2, dim=1)), dim=1) + torch.stack(q.unbind(1), dim=1)
        eq = (parts == parts).to(q.dtype)
        return ((parts + r + f + top) * eq).clamp(min=-3.0, max=3.0) + q.select(1, 0)[:, None]


def test_same_ops_on_every_binding_chosen_by_name() -> None:
    torch.manual_seed(0)
    model, x = _EveryOp(), torch.randn(4, 6)
    captured = capture(model, (x,))
    names = {str(n.target) for n in captured.module.graph.nodes if n.op == "call_function"}
    for needed in ("aten.split.Tensor", "aten.softmax.int", "aten.where.self", "aten.max.dim",
                   "aten.arange.start_step", "aten.select.int", "aten.clamp.default"):
        assert needed in names, needed
    _same(captured.module, [x])
    direct = direct_forward(captured.module, "test")
    assert "aten_split_Tensor(" in direct.source and "read_fc_weight()" in direct.source


def test_follows_the_live_parameters_and_re_emits_for_new_owners() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), torch.randn(3, 4)
    graph = capture(model, (x,)).module
    calls = DirectCalls("stage 0")
    first = calls(graph, [x], step=1)[0]
    assert torch.equal(first, graph(x)[0])
    # a loaded state (in place, or assigned: the owner's dict gets the new tensor)
    state = {k: v + 1 for k, v in graph.state_dict().items()}
    graph.load_state_dict(state, assign=True)
    assert torch.equal(calls(graph, [x], step=1)[0], graph(x)[0])
    assert not torch.equal(calls(graph, [x], step=1)[0], first)
    direct = calls._known[id(graph)][2]
    assert direct is not None and direct.valid()
    # a new owner module: found stale at the next step, emitted again
    setattr(graph, "2", nn.Linear(4, 2))
    assert not direct.valid()
    assert torch.equal(calls(graph, [x], step=2)[0], graph(x)[0])
    assert calls._known[id(graph)][2] is not direct


def test_a_module_with_hooks_is_called_as_a_module() -> None:
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)
    graph = capture(model, (x,)).module
    seen = []
    handle = graph.register_forward_hook(lambda mod, args, out: seen.append(len(args)))
    DirectCalls("stage 0")(graph, [x], step=1)
    assert seen == [1]
    handle.remove()
    DirectCalls("stage 0")(graph, [x], step=1)
    assert seen == [1]


def test_a_failing_op_shows_the_emitted_line() -> None:
    model, x = nn.Sequential(nn.Linear(4, 4)), torch.randn(2, 4)
    graph = capture(model, (x,)).module
    direct = direct_forward(graph, "stage 7")
    with pytest.raises(RuntimeError) as info:
        direct.fn(torch.randn(2, 5))
    frames = traceback.extract_tb(info.value.__traceback__)
    emitted = [f for f in frames if "stage 7, direct forward" in f.filename]
    assert emitted and "aten_linear_default(" in emitted[-1].line
    assert linecache.getline(emitted[-1].filename, emitted[-1].lineno).strip() == \
        emitted[-1].line


def test_the_pipeline_trains_through_the_direct_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, loss_fn=F.mse_loss)
    pipe.step(x, target=y)
    for worker in pipe.runtime.workers.values():
        known = worker._direct._known[id(worker.module)]
        assert known[2] is not None and known[2].module is worker.module


def test_every_op_chosen_by_name_has_a_binding() -> None:
    for full in _RESOLVED:
        name, _, overload = full.split("::", 1)[1].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        assert binding(op) is not None, full
    # an op with another functional overload, not listed: its OpOverload's own entry point
    assert binding(torch.ops.aten.add.Scalar) is None
    assert binding(torch.ops.aten.linear.default) is torch._C._nn.linear


def test_a_binding_gets_every_argument_in_the_schemas_order() -> None:
    x, t = torch.randn(2, 3), torch.randn(2, 3)
    # omitted: the schema's default (Mean = 1), not the binding's own (0, per element)
    fn, args, kwargs = direct_call(torch.ops.aten.mse_loss.default, (x, t), {})
    assert fn is torch._C._nn.mse_loss and args == (x, t, 1) and kwargs == {}
    assert fn(*args, **kwargs).shape == () and torch._C._nn.mse_loss(x, t).shape == (2, 3)
    # positional ones given by name go by position, keyword-only ones by name
    schema = torch.ops.aten.add.Tensor._schema
    assert schema_arguments(schema, (), {"self": x, "other": t}) == ((x, t), {"alpha": 1})
    assert schema_arguments(schema, (x, t), {"alpha": 2}) == ((x, t), {"alpha": 2})
    # a name the schema lacks, or one given twice: left to the overload, which says so
    assert schema_arguments(schema, (x, t), {"beta": 2}) is None
    assert schema_arguments(schema, (x, t), {"other": t}) is None
    fn, args, kwargs = direct_call(torch.ops.aten.add.Tensor, (x, t), {"other": t})
    assert fn is torch.ops.aten.add.Tensor._op and args == (x, t)
    with pytest.raises(RuntimeError, match="both as positional and keyword"):
        fn(*args, **kwargs)
    # an enum default stored as an int (`ScalarType dtype=long`): passed as its torch object
    explicit = schema_arguments(torch.ops.aten.tril_indices.default._schema, (3, 3), {})
    assert explicit is not None and explicit[1]["dtype"] is torch.long
    fn, args, kwargs = direct_call(torch.ops.aten.tril_indices.default, (3, 3), {})
    assert fn is torch._C._VariableFunctions.tril_indices
    assert torch.equal(fn(*args, **kwargs), torch.ops.aten.tril_indices.default(3, 3))


class _AuxLoss(nn.Module):
    """Three Linear layers, each adding an auxiliary loss of its output (default reduction:
    the mean) to the hidden state, as commitment or balancing losses do."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
            h = h + F.mse_loss(h, torch.zeros_like(h))
        return h


def test_a_loss_op_inside_the_model_keeps_its_reduction() -> None:
    torch.manual_seed(0)
    model = _AuxLoss().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, loss_fn=F.mse_loss)
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, F.mse_loss, 4)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads)) == 6


def test_a_causal_lm_trains_on_its_own_loss_from_labels() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                      max_position_embeddings=16, use_cache=False)
    model = LlamaForCausalLM(cfg).double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 8))

    def own_loss(out, _target):
        return out.loss

    pipe = pc.compile(model, (ids,), {"labels": ids}, devices=2, microbatches=2,
                      loss_fn=own_loss)
    loss = pipe.step(ids, labels=ids)  # the (32,)-shaped per-token loss before the fix
    ref_loss, ref_grads = reference_step(reference, (ids,), {"labels": ids}, None, own_loss, 2)
    assert loss.shape == () and torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
    assert len(assert_grads_equal(pipe, ref_grads)) == len(ref_grads)
