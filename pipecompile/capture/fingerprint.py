"""What torch.export's graph of a model depends on, as one hashable key (or None: unkeyable).

A capture may be reused for another model only when its key is equal (capture/reuse.py), so the
key holds everything export reads that can change the graph:

    the torch version and the global state export traces under (grad and inference mode,
    autocast, the default dtype, deterministic algorithms, the scaled-dot-product backends)
    every module: its path, its class, its class's code (each class of its MRO below
    nn.Module: methods by identity, class attributes by value, and the globals its methods
    name, one level deep), train/eval mode, and every other attribute of its `__dict__` by value
    (numbers, strings, flags, configs recursively, plain tensors by their contents)
    every parameter and buffer: name, type, shape, strides, dtype, device, requires_grad, and
    which names share one tensor (ties)
    the example inputs' structure, tensors' shapes, strides, dtypes, devices, requires_grad,
    and every non-tensor input by value

A model is unkeyable (never reused) when it holds what the key cannot see by value: a hook, a
tensor subclass or a fake tensor, a meta tensor outside its parameters and buffers, a value of
a kind not listed (an object with slots, a generator), a function whose closure holds such a
value, a cycle; or when a torch function or dispatch mode is active. Not seen: state reached
from the model's code only through two or more references (a global registry's class
attribute) and code replaced inside a function object in place; a process that patches those
between two compiles must not reuse captures.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import types
from typing import Any, Hashable

import torch

__all__ = ["model_key", "Unkeyable"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format)
_MAX_CONSTANT = 1 << 16  # elements of a plain tensor attribute hashed by value; more: unkeyable
_MAX_DEPTH = 12
_BASE = frozenset({object, torch.nn.Module})


class Unkeyable(Exception):
    """The model (or its inputs) holds something the key cannot see by value."""


def model_key(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
              options: tuple) -> Hashable | None:
    """The key of capturing `model(*args, **kwargs)` with `options`, or None when some part
    of it cannot be keyed by value (the capture is then never reused)."""
    try:
        return (_global_state(), options, _modules(model), _tensors(model),
                _inputs(args, kwargs))
    except Unkeyable:
        return None


def _global_state() -> tuple:
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        raise Unkeyable("a torch function or dispatch mode is active")
    from torch.nn.modules import module as nn_module

    for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_module_registration_hooks",
                 "_global_parameter_registration_hooks", "_global_buffer_registration_hooks"):
        if getattr(nn_module, name, None):
            raise Unkeyable(f"a global module hook ({name})")
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                     for d in ("cpu", "cuda"))
    sdp = torch.backends.cuda
    return (torch.__version__, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            autocast, torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            (sdp.flash_sdp_enabled(), sdp.mem_efficient_sdp_enabled(), sdp.math_sdp_enabled(),
             sdp.cudnn_sdp_enabled()), torch.backends.mkldnn.enabled)


def _modules(model: torch.nn.Module) -> tuple:
    classes: dict[type, tuple] = {}
    entries = []
    for path, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        if cls not in classes:
            classes[cls] = _class(cls)
        attributes = []
        for name, value in vars(module).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue  # the tensors: _tensors; the submodules: their own entries
            if "hook" in name:  # forward/backward hooks change the graph; state_dict's do not
                if value and ("forward" in name or "backward" in name):
                    raise Unkeyable(f"module {path!r} has {name}")
                continue
            attributes.append((name, _value(value, 0, ())))
        entries.append((path, cls, tuple(module._modules), tuple(attributes)))
    return tuple(entries), tuple(classes.items())


def _class(cls: type) -> tuple:
    """A class's code: each class of its MRO below nn.Module, its attributes (functions by
    identity) and the globals its functions name."""
    parts = []
    for base in cls.__mro__:
        if base in _BASE:
            continue
        for name, value in vars(base).items():
            if name in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__",
                        "__annotations__", "__slotnames__"):
                continue
            parts.append((base, name, _member(value)))
    return tuple(parts)


def _member(value: Any) -> Hashable:
    """A class attribute: a function with the globals it names, a descriptor by identity, a
    value by value (by identity where it has none)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, types.FunctionType):
        return (value, _globals_of(value))
    try:
        return _value(value, 0, ())
    except Unkeyable:
        return ("object", id(value), type(value))


def _globals_of(fn: types.FunctionType) -> tuple:
    """The module globals a function's code names (the functions and values it reads there)."""
    names: list[str] = []
    _names(fn.__code__, names)
    found: list[tuple[str, Hashable]] = []
    for name in dict.fromkeys(names):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if isinstance(value, types.ModuleType):
                found.append((name, value.__name__))
                continue
            try:
                found.append((name, _value(value, _MAX_DEPTH - 3, ())))
            except Unkeyable:
                found.append((name, ("object", id(value), type(value))))
    return tuple(found)


def _names(code: types.CodeType, into: list[str]) -> None:
    into.extend(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _names(const, into)


def _value(value: Any, depth: int, stack: tuple) -> Hashable:
    """`value` by value, recursively; Unkeyable for what has no value the key can hold."""
    kind = type(value)
    if kind in _PLAIN:
        return (kind, repr(value))  # repr: -0.0 and 0.0, and nan, stay apart
    if depth > _MAX_DEPTH or any(value is s for s in stack):
        raise Unkeyable("too deep, or a cycle")
    stack = (*stack, value)
    if isinstance(value, enum.Enum):
        return (kind, value.name)
    if isinstance(value, torch.Size):
        return (kind, tuple(value))
    if isinstance(value, (tuple, list)):
        return (kind, tuple(_value(v, depth + 1, stack) for v in value))
    if isinstance(value, (set, frozenset)):
        return (kind, frozenset(_value(v, depth + 1, stack) for v in value))
    if isinstance(value, dict):
        return (kind, tuple((_value(k, depth + 1, stack), _value(v, depth + 1, stack))
                            for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return _constant(value)
    if isinstance(value, type):
        return ("class", value)
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, types.FunctionType):
        cells = tuple(_value(c.cell_contents, depth + 1, stack) for c in value.__closure__ or ())
        return (value, cells, _value(value.__defaults__, depth + 1, stack),
                _value(value.__kwdefaults__, depth + 1, stack))
    if isinstance(value, types.MethodType):
        return ("method", value.__func__, _value(value.__self__, depth + 1, stack))
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        return ("builtin", value)
    if isinstance(value, functools.partial):
        return ("partial", _value(value.func, depth + 1, stack),
                _value(value.args, depth + 1, stack), _value(value.keywords, depth + 1, stack))
    if isinstance(value, torch.nn.Module):
        raise Unkeyable("a module held outside the module tree")
    if hasattr(value, "__dict__") and not getattr(kind, "__slots__", ()):
        return (kind, _value(vars(value), depth + 1, stack))
    raise Unkeyable(f"a {kind.__qualname__} has no value the key can hold")


def _constant(tensor: torch.Tensor) -> tuple:
    """A tensor attribute that is no parameter or buffer: export may bake its contents in."""
    if type(tensor) is not torch.Tensor or tensor.device.type == "meta" \
            or tensor.numel() > _MAX_CONSTANT:
        raise Unkeyable("a tensor attribute that cannot be hashed by value")
    data = tensor.detach().cpu().contiguous()
    return ("tensor", _layout(tensor),
            hashlib.sha256(data.view(torch.uint8).numpy().tobytes()
                           if data.numel() else b"").hexdigest())


def _layout(tensor: torch.Tensor) -> tuple:
    """A parameter's, buffer's or input's layout (its values are not read by export; a meta
    model's, traced on fakes claiming a device, keys with its meta device)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        raise Unkeyable(f"a {type(tensor).__name__} on {tensor.device}")
    return (type(tensor), tuple(tensor.shape), tensor.stride(), tensor.storage_offset(),
            tensor.dtype, tensor.device, tensor.requires_grad, tensor.layout)


def _tensors(model: torch.nn.Module) -> tuple:
    """Every parameter and buffer by name, with the first name of the tensor it is (ties)."""
    first: dict[int, str] = {}
    entries: list[tuple] = []
    for path, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                full = f"{path}.{name}" if path else name
                if tensor is None:
                    entries.append((kind, full, None))
                    continue
                tie = first.setdefault(id(tensor), full)
                entries.append((kind, full, _layout(tensor), tie))
    return tuple(entries)


def _inputs(args: tuple, kwargs: dict[str, Any]) -> tuple:
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple(_layout(leaf) if isinstance(leaf, torch.Tensor)
                             else _value(leaf, 0, ()) for leaf in leaves))
