"""Checking a call's inputs against what the model was compiled with.

`compile` captured the model with one call signature: some positional inputs and some keyword
inputs (`CapturedModel.in_spec`, a pytree spec of `(args, kwargs)`). A later `pipe.step`,
`pipe(...)` or `pipe.eval_step` must pass the same inputs; otherwise flattening them against the
spec fails deep in the runtime with a bare `KeyError: 'scale'` (a missing keyword) or silently
drops an extra one. `check_inputs` compares the call's structure with the spec first and raises
a `ConfigError` naming the input and the compiled signature:

    compiled:  model(x, *, scale)          call: pipe.step(x, target=y)
    error:     pipe.step() is missing the keyword input 'scale'; the model was compiled with
               inputs (x, *, scale)

It also checks each input's rank, and its size in every dimension that capture fixed (a
sequence length the model's code makes constant, or a static-shape fallback): the error names
the input, the dimension and the captured size. The check reads only counts, names and shapes
(no tensor data), so it costs next to nothing per step.
"""

from __future__ import annotations

from typing import Any, Mapping

import sympy
import torch

from ..errors import ConfigError
from ..ir.records import CapturedModel

__all__ = ["batch_parts", "check_inputs", "compiled_signature"]


def compiled_signature(captured: CapturedModel) -> str:
    """The compiled call as text, e.g. `(x, *, scale)`; names are the captured input names
    when there is one per top-level input, else positions (`arg0`)."""
    positional, keywords = _spec_parts(captured)
    names = list(captured.input_names)
    one_each = len(names) == positional + len(keywords)
    args = [names[i] if one_each else f"arg{i}" for i in range(positional)]
    return "(" + ", ".join([*args, *(["*"] if keywords else []), *keywords]) + ")"


def check_inputs(captured: CapturedModel, args: tuple, kwargs: Mapping[str, Any], *,
                 where: str) -> None:
    """Raise a `ConfigError` if `args`/`kwargs` are not the inputs the model was compiled with
    (`where` names the call in the message, e.g. "pipe.step()")."""
    positional, keywords = _spec_parts(captured)
    signature = compiled_signature(captured)
    missing = [k for k in keywords if k not in kwargs]
    extra = [k for k in kwargs if k not in keywords]
    hint = ("; the model was captured with torch.fx: pass inputs positionally in forward's "
            "order" if captured.method == "fx" else "")
    if missing:
        raise ConfigError(
            f"{where} is missing the keyword input{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(repr, missing))}; the model was compiled with inputs {signature}: "
            f"pass {', '.join(f'{k}=...' for k in missing)}")
    if extra:
        raise ConfigError(
            f"{where} got the keyword input{'s' if len(extra) > 1 else ''} "
            f"{', '.join(map(repr, extra))} that the model was not compiled with; it was "
            f"compiled with inputs {signature}{hint}. Recompile with example_kwargs including "
            f"it, or leave it out")
    if len(args) != positional:
        raise ConfigError(
            f"{where} got {len(args)} positional input{'s' if len(args) != 1 else ''} but the "
            f"model was compiled with {positional}: inputs {signature}")
    try:
        flat = captured.flatten_inputs(args, kwargs)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"{where}: the inputs do not have the structure the model was compiled with "
            f"({signature}, nested as {captured.in_spec}): {type(exc).__name__}: {exc}") from exc
    _check_sizes(captured, flat, where)


def _check_sizes(captured: CapturedModel, flat: list[Any], where: str) -> None:
    """Every input has the captured rank, and the captured size wherever capture fixed one
    (dimension 0, the batch, is split and checked by the micro-batching)."""
    for name, value in zip(captured.input_names, flat):
        shape = captured.values[name].shape
        if not isinstance(value, torch.Tensor) or captured.values[name].dtype is None:
            continue
        if value.dim() != len(shape):
            raise ConfigError(
                f"{where}: input {name!r} has {value.dim()} dimensions but the model was "
                f"compiled with {len(shape)} (shape {_shape_text(shape)})")
        for axis, (dim, size) in enumerate(zip(shape, value.shape)):
            low, high = captured.size_ranges.get(dim, (0, None))
            if axis > 0 and not low <= size <= (size if high is None else high):
                raise ConfigError(
                    f"{where}: input {name!r} has size {size} in dimension {axis}, but the "
                    f"model was captured for sizes {low}..{'' if high is None else high} there "
                    f"(its code branches on that size, and the graph holds one branch); pass "
                    f"inputs in that range, or compile with an example of the size you need")
            if axis > 0 and isinstance(dim, (int, sympy.Integer)) and int(dim) != size:
                raise ConfigError(
                    f"{where}: input {name!r} has size {size} in dimension {axis}, but the "
                    f"model was captured with that size fixed at {int(dim)} (shape "
                    f"{_shape_text(shape)}: the model's code makes it constant, capture fell "
                    f"back to static shapes, or it kept only the batch symbolic: "
                    f"symbolic_sizes='auto' or 'batch'); pass inputs of size {int(dim)} there, "
                    f"or compile with symbolic_sizes='all' (every size symbolic) or without "
                    f"example inputs (a new plan for new sizes)")


def _shape_text(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def _spec_parts(captured: CapturedModel) -> tuple[int, list[str]]:
    """(number of positional inputs, keyword input names) of the compiled call."""
    spec = captured.in_spec
    args_spec, kwargs_spec = spec.child(0), spec.child(1)
    return args_spec.num_children, list(kwargs_spec.context or [])


def batch_parts(batch: tuple) -> tuple[tuple, dict, Any]:
    """(args, kwargs, target) of one `fit` batch given as (args, target) or (args, kwargs, target)."""
    if len(batch) == 2:
        args, target = batch
        kwargs: Mapping[str, Any] = {}
    elif len(batch) == 3:
        args, kwargs, target = batch
    else:
        raise ConfigError("each fit batch must be (args, target) or (args, kwargs, target)")
    return (args if isinstance(args, tuple) else (args,)), dict(kwargs), target
