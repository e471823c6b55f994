"""Which Python binding may stand for an ATen overload in emitted code, and with which arguments.

torch's generated Python binding of an ATen function (`torch._C._nn.mse_loss`) parses a call
0.3 to 1.2 us faster than the overload's schema-generic parser, but it is not the overload:

- its defaults are its own parse of the schema's text, and not always the schema's values:
  `int reduction=at::Reduction::Mean` reads as 0 (torch 2.13), so `torch._C._nn.mse_loss(x, t)`
  is the per-element loss where `aten.mse_loss.default(x, t)` is the mean (likewise
  `nll_loss`, `cross_entropy_loss`, `l1_loss`, `smooth_l1_loss`, `kl_div`, ...);
- it picks one of the function's overloads by the Python types of what it is given.

So a binding stands for an overload only with every argument of the schema passed explicitly
(`schema_arguments`: positional ones by position in the schema's order, keyword-only ones by
name, an omitted one as the schema's own default value), and only where its parse reaches this
overload first (`binding`: the function's other overloads are `out=` forms, or the overload is
one of `_RESOLVED`). Everything else calls the overload's own C++ entry point (what
`OpOverload.__call__` calls) with the graph's arguments as recorded.
tests/runtime/test_op_binding.py checks every such pair against the signatures torch generated
the binding from; tests/runtime/test_direct_forward_opdb.py runs torch's op database through
both, bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

__all__ = ["binding", "direct_call", "full_name", "schema_arguments"]

# Ops with several non-out overloads whose Python binding picks the given overload for the
# arguments a captured graph passes (tensors where the schema has Tensor, lists where it has
# int[]): checked op by op in tests/runtime/test_direct_forward.py and, with every sample of
# torch's op database, in tests/runtime/test_direct_forward_opdb.py.
_RESOLVED = frozenset({
    "aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor", "aten::div.Tensor",
    "aten::transpose.int", "aten::split.Tensor", "aten::view", "aten::select.int",
    "aten::softmax.int", "aten::log_softmax.int", "aten::mean.dim", "aten::sum.dim_IntList",
    "aten::pow.Tensor_Scalar", "aten::where.self", "aten::masked_fill.Scalar",
    "aten::squeeze.dim", "aten::flatten.using_ints", "aten::arange", "aten::arange.start",
    "aten::arange.start_step", "aten::full", "aten::zeros", "aten::ones", "aten::max.dim",
    "aten::chunk", "aten::unbind.int", "aten::cat", "aten::stack", "aten::eq.Tensor",
    "aten::clamp", "aten::sym_size.int",
})

# Namespaces of torch's generated bindings (`python_module:` in native_functions.yaml).
_NAMESPACES = ("_VariableFunctions", "_nn", "_linalg", "_fft", "_special")

# Enum arguments whose schema default is stored as an int (`ScalarType dtype=long`,
# `MemoryFormat memory_format=contiguous_format`), which no binding takes for them: a memory
# format by c10::MemoryFormat's order (its ints in TorchScript files), a dtype as the overloads
# read it (`_dtype`), a layout not at all (no schema has such a default today).
_ENUMS = frozenset({"ScalarType", "MemoryFormat", "Layout"})
_MEMORY_FORMATS = (torch.contiguous_format, torch.preserve_format, torch.channels_last,
                   torch.channels_last_3d)


def full_name(op: torch._ops.OpOverload) -> str:
    """`aten::add.Tensor`, `aten::linear` (the default overload has no suffix)."""
    schema = op._schema
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


def binding(op: torch._ops.OpOverload) -> Callable | None:
    """torch's generated Python binding of `op`'s ATen function, where a call to it with every
    schema argument explicit can only run `op` (its other overloads are `out=` variants, or
    `op` is one of `_RESOLVED`); None where there is none."""
    schema = op._schema
    full = full_name(op)
    if full == "aten::sym_size.int":
        return torch._C.TensorBase.size  # a real tensor's size(dim): an int
    if not schema.name.startswith("aten::") or schema.is_mutable:
        return None
    packet = op._overloadpacket
    others = [getattr(packet, o)._schema for o in packet.overloads()
              if getattr(packet, o) is not op]
    if full not in _RESOLVED and any(not s.is_mutable for s in others):
        return None  # another functional overload: the binding might pick it
    name = schema.name.split("::", 1)[1]
    for namespace in _NAMESPACES:
        found = getattr(getattr(torch._C, namespace, None), name, None)
        if found is not None:
            return found
    first = schema.arguments[0] if schema.arguments else None
    method = getattr(torch._C.TensorBase, name, None) if first is not None else None
    if first is not None and first.name == "self" and callable(method):
        return method  # not a property (`is_leaf`, `data`, `_version`): those take no call
    return None


def schema_arguments(schema: torch._C.FunctionSchema, args: Sequence[Any],
                     kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """`args`/`kwargs` of a call to `schema` with every argument explicit: positional ones in
    the schema's order, keyword-only ones by name, omitted ones as the schema's defaults; None
    where the call names an argument the schema lacks, gives one twice or misses one without
    a default (left to the overload, which says so)."""
    positional: list[Any] = []
    keywords: dict[str, Any] = {}
    used, named = 0, 0
    for index, arg in enumerate(schema.arguments):
        if not arg.kwarg_only and index < len(args):
            value = args[index]
            used += 1
        elif arg.name in kwargs:
            value = kwargs[arg.name]
            named += 1
        elif arg.has_default_value():
            value = _default(arg)
            if value is _NONE:
                return None
        else:
            return None
        if arg.kwarg_only:
            keywords[arg.name] = value
        else:
            positional.append(value)
    if used != len(args) or named != len(kwargs):
        return None  # an argument the schema lacks, or one given twice: the overload says so
    return tuple(positional), keywords


_NONE = object()  # a default with no Python value a binding takes


def _default(arg: torch._C.Argument) -> Any:
    """The schema's default of `arg` as a binding takes it (an enum as its torch object)."""
    value = arg.default_value
    kind = str(getattr(arg, "real_type", arg.type)).removeprefix("Optional[").rstrip("]")
    if value is None or kind not in _ENUMS:
        return value
    if kind == "MemoryFormat" and value in range(len(_MEMORY_FORMATS)):
        return _MEMORY_FORMATS[value]
    if kind == "ScalarType" and isinstance(value, int):
        return _dtype(value)
    return _NONE


@functools.lru_cache(maxsize=None)
def _dtype(number: int) -> torch.dtype:
    """The dtype an overload reads for ScalarType `number` (TorchScript's int for it)."""
    return torch.ops.aten.empty.memory_format([0], dtype=number, device="meta").dtype


def direct_call(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any],
                ) -> tuple[Callable, tuple, dict[str, Any]]:
    """What emitted code calls for `op(*args, **kwargs)`, with which arguments: its binding
    with every argument explicit where `binding` allows, else the overload's own entry point
    (`op._op`) with the arguments unchanged."""
    found = binding(op)
    if found is not None:
        explicit = schema_arguments(op._schema, args, kwargs)
        if explicit is not None:
            return found, explicit[0], explicit[1]
    return op._op, tuple(args), dict(kwargs)
