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

The check only looks at counts and names (no tensor is touched), so it costs nothing per step.
"""

from __future__ import annotations

from typing import Any, Mapping

from .errors import ConfigError
from .ir import CapturedModel

__all__ = ["check_inputs", "compiled_signature"]


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
        captured.flatten_inputs(args, kwargs)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"{where}: the inputs do not have the structure the model was compiled with "
            f"({signature}, nested as {captured.in_spec}): {type(exc).__name__}: {exc}") from exc


def _spec_parts(captured: CapturedModel) -> tuple[int, list[str]]:
    """(number of positional inputs, keyword input names) of the compiled call."""
    spec = captured.in_spec
    args_spec, kwargs_spec = spec.child(0), spec.child(1)
    return args_spec.num_children, list(kwargs_spec.context or [])
