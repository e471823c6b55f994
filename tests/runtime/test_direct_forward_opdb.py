"""Every op family of torch's op database (`op_db`, torch's own OpInfo test set) through the
direct forward (runtime/direct_forward.py, runtime/op_binding.py) and through the recorded
overloads: the same ATen calls with the same arguments, and the same outputs bit for bit.

Each OpInfo's first CPU sample (float64 where the op has it) is captured as a graph of ATen
overloads twice, as torch.export records them (`make_fx(pre_dispatch=True)`: composite ops such
as `linear` or `cross_entropy_loss` kept) and after autograd (`make_fx()`: their decompositions,
`nll_loss_forward`, `_softmax`, ...). Both graphs run as the GraphModule and as
`direct_forward(graph).fn`, seeded alike, under a dispatch recorder: every ATen call below
autograd must be the same overload with the same arguments (tensors by dtype and shape, the
others by value, omitted ones as the schema's defaults), and every output the same value (NaN
where NaN), dtype and shape. This is what caught the bindings' own defaults: through
`torch._C._nn.mse_loss(x, t)` the loss ops ran with `reduction=0` (per element) where the
overload's default is the mean.

What is not compared is listed in `_SKIPPED` with its reason; the test counts every outcome,
fails on a skip that is not listed, and asserts that almost every family was compared.
"""

from __future__ import annotations

import collections
import functools
import os
import warnings
from typing import Any

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipecompile.runtime.direct_forward import direct_forward
from pipecompile.runtime.op_binding import binding

# Op families not compared (in either IR), by OpInfo name, with the reason.
_CUDA_ONLY = "runs only on CUDA/ROCm (jiterator)"
_READS_VALUE = "reads a tensor's value as a Python value while tracing: make_fx cannot capture it"
_SPARSE_CSR = "a sparse CSR input: make_fx cannot trace a tensor without strides"
_NO_DTYPE = "no CPU dtype"
_NO_OP = "the captured graph calls no ATen overload"
_SKIPPED: dict[str, str] = {
    "jiterator_unary": _CUDA_ONLY,
    "jiterator_binary": _CUDA_ONLY,
    "jiterator_binary_return_by_ref": _CUDA_ONLY,
    "jiterator_2inputs_2outputs": _CUDA_ONLY,
    "jiterator_4inputs_with_extra_args": _CUDA_ONLY,
    "item": _READS_VALUE,
    "allclose": _READS_VALUE,
    "equal": _READS_VALUE,
    "nn.functional.gaussian_nll_loss": _READS_VALUE,  # checks `torch.any(var < 0)`
    "sparse.sampled_addmm": _SPARSE_CSR,
    "sparse.mm": _SPARSE_CSR,
}
# ... and after autograd only: their decompositions read a value (`torch.equal`, `.item()`).
_SKIPPED_AFTER_AUTOGRAD: dict[str, str] = {
    "corrcoef": _READS_VALUE, "cov": _READS_VALUE, "istft": _READS_VALUE,
    "nn.functional.one_hot": _READS_VALUE,
}

# Ops whose outputs are uninitialised memory: the same op, arguments, dtype and shape, and not
# the same values (not even from two runs of the same graph).
_UNINITIALISED = frozenset({
    "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided",
})
_DTYPES = (torch.float64, torch.float32, torch.int64, torch.bool, torch.complex128,
           torch.int32, torch.uint8)


@functools.cache
def _op_db() -> list:
    """torch's op database, its import's global changes undone (it freezes torch.backends'
    flags, adds warning filters and sets TORCHINDUCTOR_CACHE_DIR for a test process of its own)."""
    filters, env = list(warnings.filters), dict(os.environ)
    flags_frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db

    warnings.filters[:] = filters
    for key in set(os.environ) - set(env):
        del os.environ[key]
    if not flags_frozen:
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
    return list(op_db)


def _first_sample(info: Any) -> tuple[Any, str | None]:
    """The OpInfo's first CPU sample (its sample function called directly: `sample_inputs`
    walks the whole stack to find a test name on every call), or a reason why none."""
    dtypes = info.supported_dtypes("cpu")
    dtype = next((d for d in _DTYPES if d in dtypes), next(iter(dtypes), None))
    if dtype is None:
        return None, _NO_DTYPE
    torch.manual_seed(0)
    samples = iter(info.sample_inputs_func(info, "cpu", dtype, False))
    try:
        return next(samples), None
    finally:
        getattr(samples, "close", lambda: None)()  # leave no generator's no_grad open


class _Calls(TorchDispatchMode):
    """Every ATen call dispatched below autograd: the overload and its arguments by name
    (tensors as dtype and shape, omitted ones as the schema's default values)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        named = []
        for i, arg in enumerate(func._schema.arguments):
            if not arg.kwarg_only and i < len(args):
                value = args[i]
            elif arg.name in kwargs:
                value = kwargs[arg.name]
            else:
                value = arg.default_value if arg.has_default_value() else "<missing>"
            if arg.name == "pin_memory" and value is None:
                # a factory binding packs dtype/layout/device/pin_memory into TensorOptions,
                # from which an unset pin_memory comes back as False: the same allocation
                value = False
            named.append((arg.name, _key(value)))
        self.calls.append((str(func), tuple(named)))
        return func(*args, **kwargs)


def _key(value: Any) -> Any:
    """A comparable stand-in for an argument (a tensor by its dtype, shape and layout)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.layout)
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def _same(a: Any, b: Any, values: bool = True) -> bool:
    """Bitwise the same tensor (NaN where NaN; the same dtype, shape and layout), or equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if (a.dtype, a.shape, a.layout) != (b.dtype, b.shape, b.layout):
            return False
        if not values:
            return True
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and a != a:
        return b != b
    return type(a) is type(b) and (not values or a == b)


def _run(fn: Any, tensors: list[torch.Tensor]) -> tuple[list, list]:
    """(flat outputs, dispatched calls) of fn on fresh copies of `tensors`, seeded."""
    inputs = [t.clone() for t in tensors]
    torch.manual_seed(0)
    with _Calls() as calls:
        out = fn(*inputs)
    return tree_flatten(out)[0], calls.calls


def _capture(info: Any, sample: Any, pre_dispatch: bool) -> tuple[Any, list[torch.Tensor]]:
    """The sample's call captured as a graph of ATen overloads, and its tensor inputs."""
    flat, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    def call(*tensors: torch.Tensor) -> Any:
        values = list(flat)
        for i, t in zip(where, tensors):
            values[i] = t
        first, args, kwargs = tree_unflatten(values, spec)
        return info(first, *args, **kwargs)

    tensors = [flat[i].clone() for i in where]
    torch.manual_seed(0)
    return make_fx(call, pre_dispatch=pre_dispatch)(*tensors), tensors


def _compare(info: Any, graph: torch.fx.GraphModule, tensors: list[torch.Tensor]) -> str:
    """'same' (or why nothing was compared); raises AssertionError naming the op and the
    difference."""
    if not any(isinstance(n.target, torch._ops.OpOverload) for n in graph.graph.nodes):
        return _NO_OP
    direct = direct_forward(graph, "opdb")
    assert direct is not None
    out0, calls0 = _run(graph, tensors)
    out1, calls1 = _run(direct.fn, tensors)
    name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
    differ = [(a, b) for a, b in zip(calls0, calls1) if a != b]
    assert calls0 == calls1, f"{name}: dispatched calls differ: {differ[:2] or 'in number'}"
    assert len(out0) == len(out1), f"{name}: {len(out0)} outputs vs {len(out1)}"
    values = info.name not in _UNINITIALISED
    for i, (a, b) in enumerate(zip(out0, out1)):
        assert _same(a, b, values), f"{name}: output {i} differs ({a!r} vs {b!r})"[:400]
    return "same"


@pytest.mark.parametrize("pre_dispatch", [True, False], ids=["export-ir", "aten-ir"])
def test_every_op_db_family_runs_the_recorded_overload_bit_for_bit(pre_dispatch) -> None:
    outcomes: collections.Counter = collections.Counter()
    compared, families, unlisted, identity = set(), set(), [], []
    skipped = _SKIPPED if pre_dispatch else {**_SKIPPED, **_SKIPPED_AFTER_AUTOGRAD}
    for info in _op_db():
        families.add(info.name)
        sample, reason = _first_sample(info)
        if sample is not None:
            try:
                graph, tensors = _capture(info, sample, pre_dispatch)
            except Exception as error:  # noqa: BLE001 - cannot run or capture: must be listed
                reason = skipped.get(info.name, f"capture failed: {error!r}"[:200])
            else:
                reason = _compare(info, graph, tensors)
        if reason == "same":
            compared.add(info.name)
        elif reason == _NO_OP:
            identity.append(info.name)  # `contiguous`, `conj` of a real tensor, p=0 dropout
        elif reason not in (skipped.get(info.name), _NO_DTYPE):
            unlisted.append((info.name, reason))
        outcomes[reason] += 1
    assert not unlisted, unlisted
    assert len(identity) < 30, identity
    assert outcomes["same"] > 0.9 * len(_op_db()), outcomes
    assert len(compared) > 0.9 * len(families), (len(compared), len(families), outcomes)


def _call_op(op: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return op(a, b)


def test_the_loss_ops_bindings_differ_from_their_overloads_without_explicit_arguments() -> None:
    """Why every argument is passed: torch's bindings read `reduction=at::Reduction::Mean` as
    0 (per element); through the direct call the loss is the overload's mean."""
    x, t = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    for op, args in [(torch.ops.aten.mse_loss.default, (x, t)),
                     (torch.ops.aten.l1_loss.default, (x, t)),
                     (torch.ops.aten.smooth_l1_loss.default, (x, t))]:
        found = binding(op)
        assert found is not None, op
        assert found(*args).shape == x.shape and op(*args).shape == ()  # the hazard
        graph = make_fx(functools.partial(_call_op, op), pre_dispatch=True)(*args)
        direct = direct_forward(graph, "loss")
        assert direct is not None
        assert f"aten_{op._schema.name[6:]}_default(arg0_1, arg1_1, 1" in direct.source  # Mean
        assert torch.equal(direct.fn(*args), op(*args))
