"""passes/opaque.py step by step (tests/capture/test_opaque.py runs it through capture): what
`record` measures of a module, the fake outputs export sees, and `restore` turning the opaque op
back into a call of the module that computes what the model computes."""

from __future__ import annotations

import pytest
import torch

from pipecompile.errors import OpaqueModuleError
from pipecompile.capture import opaque


class _Routed(torch.nn.Module):
    """Data-dependent: keeps the rows whose first feature is positive (export cannot trace)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)

    def forward(self, x, *, scale=1.0):
        y = self.proj(x) * scale
        keep = (x[:, 0] > 0).nonzero().flatten()
        return y, y.index_fill(0, keep, 0.0).sum(dim=1, keepdim=True)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(3, 6)
        self.routed = _Routed()
        self.out = torch.nn.Linear(5, 2)

    def forward(self, x):
        y, s = self.routed(self.inp(x), scale=2.0)
        return self.out(torch.cat([y, s], dim=1))


def test_record_measures_shapes_batch_and_flops_per_sample():
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(8, 3)
    specs = opaque.record(model, (x,), {}, ["routed"], "data-dependent", batch=8)
    spec = specs["routed"]
    assert spec.path == "routed" and spec.type_name == "_Routed"
    assert repr(spec) == "OpaqueModule('routed', _Routed: data-dependent)"
    # outputs (8, 4) and (8, 1): the batch dim follows input 0's dim 0, the others are constant
    assert spec.outputs == (((("in", 0, 0), ("const", 4)), torch.float32),
                            ((("in", 0, 0), ("const", 1)), torch.float32))
    assert spec.batch == (0, 0)
    # the Linear(6, 4) is the only matmul: 2 * 6 * 4 FLOPs per sample
    assert spec.flops_per_sample == 2 * 6 * 4
    # the module's result structure: a 2-tuple
    assert torch.utils._pytree.tree_unflatten([1, 2], spec.out_spec) == (1, 2)
    assert not spec.random  # it draws no random numbers


def test_record_notes_a_module_drawing_random_numbers():
    """Dropout inside the module (not attention with dropout_p=0) makes it `random`: with
    rng="per-microbatch" it then runs on a stream of its own (ir/rng.py)."""
    class Noisy(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            q = x[:, None, :, None].expand(-1, 1, -1, 2)
            attended = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0)
            return torch.nn.functional.dropout(x, self.p) + attended.sum(-1)[:, 0]

    x = torch.randn(4, 3)
    for p, random in ((0.5, True), (0.0, False)):
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), Noisy(p))
        assert opaque.record(model, (x,), {}, ["1"], "why", batch=4)["1"].random is random


def test_fake_outputs_follow_the_batch_of_the_inputs():
    model = _Model()
    spec = opaque.record(model, (torch.randn(8, 3),), {}, ["routed"], "why", batch=8)["routed"]
    outs = opaque.fake_outputs(spec, [torch.empty(5, 6)])
    assert [tuple(o.shape) for o in outs] == [(5, 4), (5, 1)]


def test_record_refuses_a_module_returning_a_non_tensor():
    class Counts(torch.nn.Module):
        def forward(self, x):
            return x, int((x > 0).sum())

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.counts = Counts()

        def forward(self, x):
            return self.counts(x)[0]

    with pytest.raises(OpaqueModuleError, match="module 'counts' returns a int"):
        opaque.record(Outer(), (torch.randn(2, 3),), {}, ["counts"], "why", batch=2)


def test_export_with_the_opaque_op_then_restore_computes_the_model():
    torch.manual_seed(0)
    model = _Model()
    x = torch.randn(8, 3)
    x[::2, 0] = -1.0  # the routing depends on the values: half the rows are kept
    specs = opaque.record(model, (x,), {}, ["routed"], "data-dependent", batch=8)
    with opaque.exporting(model, specs) as calls:
        exported = torch.export.export(model, (x,), strict=False)
    assert "forward" not in model.routed.__dict__  # the patch is gone after export
    gm = exported.module()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.pipecompile.opaque.default in targets
    opaque.restore(gm, specs, calls, model)
    calls_made = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert [t for t in calls_made if t != "_guards_fn"] == ["routed"]  # export's guard check
    assert torch.ops.pipecompile.opaque.default not in [n.target for n in gm.graph.nodes]
    # the restored call runs the module eagerly, with its own parameters (not copies)
    assert gm.get_submodule("routed").proj.weight is model.routed.proj.weight
    x2 = torch.randn(8, 3)
    torch.testing.assert_close(gm(x2), model(x2), rtol=0, atol=0)
    # its result flat: what the graph reads by index
    y, s = model.routed(torch.randn(4, 6))
    assert opaque.flat_outputs((y, {"s": s})) == (y, s)


def test_an_opaque_call_with_none_among_its_inputs_and_outputs_is_restored():
    class Masked(torch.nn.Module):  # called as transformers call layers: mask=None
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(3, 3)

        def forward(self, x, mask=None, scale=None):
            y = self.proj(x)
            return (y if mask is None else y * mask), None  # an output not asked for

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Masked()

        def forward(self, x):
            y, nothing = self.inner(x, mask=None, scale=None)
            assert nothing is None
            return y + 1

    torch.manual_seed(0)
    model, x = Outer(), torch.randn(4, 3)
    specs = opaque.record(model, (x,), {}, ["inner"], "why", batch=4)
    assert specs["inner"].nones == (1,) and len(specs["inner"].outputs) == 1
    with opaque.exporting(model, specs) as calls:
        gm = torch.export.export(model, (x,), strict=False).module()
    opaque.restore(gm, specs, calls, model)  # today's main: IndexError (None taken for a tensor)
    call = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "inner")
    assert call.kwargs == {"mask": None, "scale": None}
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
