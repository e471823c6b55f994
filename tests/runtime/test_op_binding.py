"""Every ATen overload that runtime/op_binding.py lets a Python binding stand for, checked
against the signatures torch generated that binding from (torchgen, the generator shipped with
torch, run on the same native_functions.yaml): the binding's signature for the overload takes
the schema's positional arguments in the schema's order and its keyword-only ones by name, and
no other signature of the binding (another overload, a deprecated form) is tried before it with
room for the same call, unless the overload is one of `_RESOLVED` (picked by the arguments'
types, checked by running them in test_direct_forward.py and test_direct_forward_opdb.py).
Bindings written by hand in torch (`TensorBase.contiguous`, ...) are listed and run here.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

import torch

from pipecompile.runtime.op_binding import (
    _MEMORY_FORMATS,
    _RESOLVED,
    _default,
    binding,
    direct_call,
    full_name,
)

# Bindings torch writes by hand (not generated from the schema), each run below against its
# overload: what they return for a real tensor is the overload's result.
_MANUAL = frozenset({
    "aten::contiguous", "aten::dim", "aten::get_device", "aten::item", "aten::nonzero",
    "aten::numel", "aten::storage_offset", "aten::sym_size.int",
})


@functools.cache
def _generated() -> dict[str, dict[str, list]]:
    """namespace (`_nn`, `TensorBase`, ...) -> binding name -> its signature groups, in the
    order the generated parser tries them."""
    import torchgen
    from torchgen.gen import parse_native_yaml
    from torchgen.packaged.autograd import gen_python_functions as gen

    root = os.path.join(os.path.dirname(torchgen.__file__), "packaged")
    native = os.path.join(root, "ATen", "native")
    functions = [f for f in parse_native_yaml(os.path.join(native, "native_functions.yaml"),
                                              os.path.join(native, "tags.yaml")).native_functions
                 if gen.should_generate_py_binding(f)]
    deprecated = os.path.join(root, "autograd", "deprecated.yaml")
    plain = gen.load_signatures(functions, deprecated, method=False)
    methods = gen.load_signatures(functions, deprecated, method=True)
    kinds = {"_VariableFunctions": (plain, gen.is_py_torch_function),
             "_nn": (plain, gen.is_py_nn_function), "_linalg": (plain, gen.is_py_linalg_function),
             "_fft": (plain, gen.is_py_fft_function),
             "_special": (plain, gen.is_py_special_function),
             "TensorBase": (methods, gen.is_py_variable_method)}
    return {namespace: {str(name): list(gen.group_overloads(pairs, symint=True))
                        for name, pairs in gen.group_filter_overloads(found, pred).items()}
            for namespace, (found, pred) in kinds.items()}


def _namespace(op: torch._ops.OpOverload, fn: Any) -> str | None:
    name = op._schema.name.split("::", 1)[1]
    for namespace in ("_VariableFunctions", "_nn", "_linalg", "_fft", "_special"):
        if getattr(getattr(torch._C, namespace), name, None) is fn:
            return namespace
    return "TensorBase" if getattr(torch._C.TensorBase, name, None) is fn else None


def _fits(signature: Any, positional: int, keywords: list[str]) -> bool:
    """Whether the parser could bind `positional` arguments and `keywords` to `signature`
    (by count and names; the types decide among those that can)."""
    names = [a.name for a in signature.input_args]  # a method's has no `self`
    rest = {a.name for a in signature.input_kwargs} | {a.name for a in
                                                        signature.tensor_options_args}
    rest |= {"out"} if signature.output_args else set()
    if positional > len(names) or not set(keywords) <= set(names[positional:]) | rest:
        return False
    unfilled = [a for a in list(signature.input_args)[positional:]
                + list(signature.input_kwargs) if a.default is None and a.name not in keywords]
    return not unfilled


def _overloads() -> list[torch._ops.OpOverload]:
    """Every registered aten overload (by the dispatcher's names: `dir(torch.ops.aten)` lists
    only the packets this process has loaded so far, which depends on the tests run before)."""
    found = []
    names = {n.split("::", 1)[1].split(".", 1)[0] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("aten::")}
    for name in sorted(names):
        packet = getattr(torch.ops.aten, name, None)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            found.extend(getattr(packet, o) for o in packet.overloads())
    return found


def test_every_binding_takes_its_overloads_arguments_in_the_schemas_order() -> None:
    tables = _generated()
    outcomes: collections.Counter = collections.Counter()
    manual, wrong = set(), []
    for op in _overloads():
        fn = binding(op)
        if fn is None:
            continue
        full, namespace = full_name(op), _namespace(op, fn)
        name, overload = op._schema.name.split("::", 1)[1], op._schema.overload_name
        groups = tables.get(namespace or "", {}).get(name)
        if groups is None:
            manual.add(full)
            continue
        method = namespace == "TensorBase"
        own = [g for g in groups if str(g.base.func.name.name) == name
               and g.base.func.name.overload_name == overload
               and type(g.signature).__name__ == "PythonSignature"]
        if len(own) != 1:
            wrong.append((full, f"{len(own)} signatures of its own"))
            continue
        signature = own[0].signature
        # (the parser shows a function's `self` as `input`; the names are not passed)
        schema_positional = [a.name for a in op._schema.arguments if not a.kwarg_only]
        keywords = [a.name for a in op._schema.arguments if a.kwarg_only]
        positional = [a.name for a in signature.input_args]
        if method:
            schema_positional = schema_positional[1:]  # `self`: the tensor it is called on
        if positional != schema_positional or not _fits(signature, len(positional), keywords):
            wrong.append((full, positional, schema_positional, keywords))
            continue
        before = [str(g.base.func.name) for g in groups[:groups.index(own[0])]
                  if _fits(g.signature, len(positional), keywords)]
        if before and full not in _RESOLVED:
            wrong.append((full, "tried first:", before))
        outcomes["resolved by type" if before else "its own signature first"] += 1
        outcomes[namespace] += 1
    assert not wrong, wrong
    assert manual == _MANUAL, manual ^ _MANUAL
    assert outcomes["its own signature first"] > 350, outcomes
    assert outcomes["_nn"] > 20 and outcomes["TensorBase"] > 10, outcomes


def test_the_hand_written_bindings_return_the_overloads_results() -> None:
    x = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, -1.0]]).t()  # not contiguous
    calls = {"aten::contiguous": (x,), "aten::dim": (x,), "aten::item": (x[1, 0],),
             "aten::nonzero": (x,), "aten::numel": (x,), "aten::storage_offset": (x[1],),
             "aten::get_device": (x,),
             "aten::sym_size.int": (x, 1)}
    assert set(calls) == _MANUAL
    for full, args in calls.items():
        name, _, overload = full.split("::", 1)[1].partition(".")
        op = getattr(getattr(torch.ops.aten, name), overload or "default")
        fn, explicit, kwargs = direct_call(op, args, {})
        assert fn is binding(op) and fn is not None, full
        got, want = fn(*explicit, **kwargs), op(*args)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want) and got.stride() == want.stride(), full
        else:
            assert type(got) is type(want) and got == want, full


def test_enum_defaults_stored_as_ints_are_passed_as_the_overloads_read_them() -> None:
    # the memory formats' order: each int, read by an overload, lays out as its torch object
    x = torch.randn(2, 3, 4, 5, 6)
    for number, fmt in enumerate(_MEMORY_FORMATS):
        source = x if fmt is not torch.channels_last else x[0]
        if fmt is torch.preserve_format:
            source = x[0].contiguous(memory_format=torch.channels_last)
        got = torch.ops.aten.clone.default(source, memory_format=number)
        assert got.stride() == source.clone(memory_format=fmt).stride(), fmt
    # every such default in torch's schemas has a value a binding takes
    seen = collections.Counter()
    for op in _overloads():
        for arg in op._schema.arguments:
            kind = str(arg.real_type).removeprefix("Optional[").rstrip("]")
            if kind in ("ScalarType", "MemoryFormat", "Layout") and arg.has_default_value() \
                    and arg.default_value is not None:
                value = _default(arg)
                assert isinstance(value, (torch.dtype, torch.memory_format)), (op, arg.name)
                seen[kind] += 1
    assert seen["ScalarType"] > 0 and seen["MemoryFormat"] > 0, seen
