"""Why a capture failed: the module and line that stopped it, and an error with only the hints
that apply (data-dependent branching, a KV cache, another capture method, verbose output).

Blame goes by frame, not by file and line. The failure's traceback is walked from the
innermost frame out: the first frame that runs a method of one of the model's modules (the
frame's first argument *is* that module instance, not merely code at the same line) names the
module; the innermost frame of the model's own code at or inside it (not torch's, sympy's,
Python's or pipecompile's) names the file and line:

    torch/.../symbolic_shapes.py   evaluate_expr        library
    my_model.py:42                 EncoderLayer.forward  self is encoder.layers.0  -> blamed
    transformers/utils/generic.py  wrapper               a decorator shared by the encoder
                                                         and the decoder: never reached

A module shared by two classes' decorators, two instances of one class (an encoder and a
decoder `T5Stack`) or a forward patched at run time is told apart by the instance. Only where
the traceback holds no model frame (torch raised after tracing) are the frames that torch's
message quotes, or the module attribute it names (`b.lifted_tensor_0`), mapped back.
"""

from __future__ import annotations

import inspect
import os
import re
import sysconfig
import types
from typing import Any, Iterable, Mapping

import sympy
import torch

from ..errors import CaptureError

__all__ = ["Site", "batch_constraint", "capture_error", "failing_submodule", "failure_site", "first_line",
           "frame_site", "module_paths", "opaque_reason", "where"]

Site = tuple[str, str, int]  # (module path, '' for the root; file; line)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def module_paths(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> its path in `model` (the first, for a module reached under two)."""
    paths: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), name)
    return paths


def frame_site(paths: Mapping[int, str], frames: Iterable[tuple[types.FrameType, int]]
               ) -> Site | None:
    """The innermost frame (frames given innermost first, with their line) running a method of
    a module in `paths`, and the innermost line of the model's own code: inside that frame, or
    where the model calls it when the module is torch's own (an `nn.Linear`)."""
    line: tuple[str, int] | None = None
    found: tuple[str, str, int] | None = None
    for frame, lineno in frames:
        code = frame.f_code
        if line is None and not _library(code.co_filename):
            line = (code.co_filename, lineno)
        if found is None and code not in _MACHINERY and code.co_argcount:
            owner = frame.f_locals.get(code.co_varnames[0])
            if (isinstance(owner, torch.nn.Module) and id(owner) in paths
                    and _method_of(owner, code)):
                found = (paths[id(owner)], code.co_filename, lineno)
        if found is not None and line is not None:
            return found[0], line[0], line[1]
    return found


def _method_of(owner: torch.nn.Module, code: types.CodeType) -> bool:
    """Whether `code` is a method of `owner` (its class's, under any decorators, or set on the
    instance): torch's own functions taking the model first (`_export(mod, ...)`) are not."""
    candidates = [v for klass in type(owner).__mro__ for v in vars(klass).values()]
    candidates += [getattr(v, "__func__", v) for v in vars(owner).values() if callable(v)]
    for value in candidates:
        while value is not None:
            if getattr(value, "__code__", None) is code:
                return True
            value = getattr(value, "__wrapped__", None)
    return False


def failure_site(model: torch.nn.Module, exc: BaseException) -> Site | None:
    """Where the model's code stopped the capture (see the module docstring)."""
    paths = module_paths(model)
    for error in _chain(exc):
        site = frame_site(paths, _traceback_frames(error))
        if site is not None:
            return site
    return _message_site(model, str(exc))


def opaque_reason(model: torch.nn.Module, exc: BaseException) -> str:
    """Why a module is kept opaque: torch's message, short, and where."""
    text = first_line(exc).split(" (unhinted")[0]
    site = failure_site(model, exc)
    return f"{text} at {site[1]}:{site[2]}" if site else text


def failing_submodule(model: torch.nn.Module, exc: BaseException) -> str | None:
    """The submodule (never the root) whose own code stopped the capture, if one did; None
    when the batch size could not be dynamic (then static shapes are tried instead)."""
    if batch_constraint(exc):
        return None
    site = failure_site(model, exc)
    return site[0] if site is not None and site[0] else None


def batch_constraint(exc: BaseException) -> bool:
    """Whether export failed because a size marked dynamic (the batch) could not be."""
    return type(exc).__name__ == "ConstraintViolationError" or "Constraints violated" in str(exc)


def where(model: torch.nn.Module, site: Site | None) -> str:
    """' in module 'path' (Class) at file:line'; without a site, where the model's forward
    is (the failure came from no frame of the model's code)."""
    if site is not None:
        name, filename, line = site
        return (f" in module {name or '<root>'!r} ({type(model.get_submodule(name)).__name__})"
                f" at {filename}:{line}")
    forward = type(model).forward
    found = _source(forward) if forward is not torch.nn.Module.forward else None
    at = f"; {type(model).__name__}.forward is at {found[0]}:{found[1]}" if found else ""
    return f" (no frame of the model's code on torch's stack{at})"


def capture_error(model: torch.nn.Module, tool: str, exc: BaseException, alternative: str,
                  opaque: Mapping[str, Any] | None = None) -> CaptureError:
    """A CaptureError naming the module whose code failed, with the hints that apply;
    `alternative` (another capture method known to trace the model, or '') is suggested only
    where nothing more specific applies."""
    site = failure_site(model, exc)
    text = str(exc)
    hints = []
    if "data-dependent" in text or "DataDependent" in type(exc).__name__:
        hints.append("branch on tensor values with torch.where or torch.cond instead of Python "
                     "`if`" + (" (the root module's own code cannot be kept opaque: move that "
                               "code into a submodule)" if site and not site[0] else ""))
    elif batch_constraint(exc):  # capture='fx' would capture it, then fail on a micro-batch
        hints.append("the model fixes its batch size (a reshape or view to constant sizes such "
                     "as h.reshape(4, 8)): compute it from the input (h.reshape(-1, 8), "
                     "x.shape[0]) so that micro-batches run, or compile with microbatches=1")
    elif alternative:
        hints.append(f"try {alternative}")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) or "Cache" in text:
        hints.append("build the model with use_cache=False (a KV cache cannot be captured)")
    loss = _loss_frame(exc)
    if loss is not None:
        hints.append(
            f"the failing code is the model's own loss ({loss}): compile the model without the "
            f"argument that makes it compute the loss (labels=) and compute that loss in "
            f"compile(..., loss_fn=lambda out, target: ...) from the model's outputs; "
            f"step(..., target=labels) passes the labels to it")
    elif not hints:
        hints.append("make that code traceable by torch.export (no untraceable calls)")
    if opaque:
        hints.append(f"already kept opaque: {', '.join(opaque)}")
    if getattr(exc, "pipecompile_details", ""):
        hints.append("compile(..., verbose=True) shows torch's own output")
    error = CaptureError(
        f"{tool} could not capture {type(model).__name__}{where(model, site)}: "
        f"{first_line(exc)}. " + "; ".join(hints) + ".")
    error.details = getattr(exc, "pipecompile_details", "")  # type: ignore[attr-defined]
    return error


# ---------------------------------------------------------------------------------------------

# nn.Module's own methods (__call__, _call_impl, __getattr__, ...): their frames run a module
# but no code of the model
_MACHINERY = frozenset(f.__code__ for f in vars(torch.nn.Module).values()
                       if isinstance(f, types.FunctionType))
_PURELIB = sysconfig.get_paths()["purelib"]
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pipecompile/
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sympy)
                   if m.__file__) + (_PACKAGE + os.sep,)


def _library(filename: str) -> bool:
    """Code that is not the model's: torch, sympy, pipecompile, Python's own."""
    if filename.startswith(_LIBRARIES) or filename.startswith("<frozen"):
        return True
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    return filename.startswith(stdlib) and not filename.startswith(_PURELIB)


def _chain(exc: BaseException) -> list[BaseException]:
    """exc, then what it was raised from or during (torch re-raises)."""
    chain: list[BaseException] = []
    error: BaseException | None = exc
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def _loss_frame(exc: BaseException) -> str | None:
    """'function at file:line' of the innermost frame of the model's code (not torch's or
    pipecompile's) computing a loss (a function or file named so: transformers' `ForCTCLoss`
    in loss_ctc.py, a model's `loss_function`), if the failure came from one."""
    for error in _chain(exc):
        for frame, line in _traceback_frames(error):
            code = frame.f_code
            if _library(code.co_filename):
                continue
            if "loss" in code.co_name.lower() or "loss" in os.path.basename(
                    code.co_filename).lower():
                return f"{code.co_name} at {code.co_filename}:{line}"
    return None


def _traceback_frames(exc: BaseException) -> list[tuple[types.FrameType, int]]:
    """exc's traceback frames, innermost first, with the line each was at."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return frames[::-1]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')
_ATTRIBUTE = re.compile(r"model attribute: ([\w.]+)\.lifted_tensor_\d+")


def _message_site(model: torch.nn.Module, text: str) -> Site | None:
    """The frames torch's message quotes (innermost last), or the module attribute it names."""
    for filename, line, _ in reversed(_FRAME.findall(text)):
        name = _module_at(model, filename, int(line))
        if name is not None:
            return name, filename, int(line)
    match = _ATTRIBUTE.search(text)
    if match:
        path = match.group(1)
        try:
            module = model.get_submodule(path)
        except AttributeError:
            return None
        found = _source(type(module).forward)
        if found:
            return path, found[0], found[1]
    return None


def _module_at(model: torch.nn.Module, filename: str, line: int) -> str | None:
    """Path of the deepest submodule whose forward's own source (under its decorators)
    contains filename:line; None where instances of two classes could be meant (one class's
    instances are all kept opaque together, so its first stands for them)."""
    best: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        found = _source(type(module).forward)
        if found and found[0] == filename and found[1] <= line < found[1] + found[2]:
            if not best or _depth(name) > _depth(best[0][0]):
                best = [(name, module)]
            elif _depth(name) == _depth(best[0][0]):
                best.append((name, module))
    if not best or len({type(m) for _, m in best}) > 1:
        return None
    return best[0][0]


def _depth(path: str) -> int:
    return path.count(".") if path else -1


def _source(function: Any) -> tuple[str, int, int] | None:
    """(file, first line, line count) of a function's own source, decorators unwrapped."""
    try:
        function = inspect.unwrap(function)
        lines, start = inspect.getsourcelines(function)
        filename = inspect.getsourcefile(function)
    except (OSError, TypeError, ValueError):
        return None
    return (filename, start, len(lines)) if filename else None

