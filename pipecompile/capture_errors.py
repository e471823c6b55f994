"""Why a capture failed: the module and line that stopped it, and an error with only the hints
that apply (data-dependent branching, a KV cache, another capture method, verbose output)."""

from __future__ import annotations

import inspect
import re
from typing import Any, Mapping

import torch

from .errors import CaptureError

__all__ = ["capture_error", "failing_submodule", "first_line", "opaque_reason"]



def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def _failure_site(model: torch.nn.Module, exc: BaseException) -> tuple[str, str, int] | None:
    """(module path, file, line) of the innermost model code on the failure's stack."""
    frames: list[tuple[str, int, object]] = [
        (f, int(n), None) for f, n, _ in _FRAME.findall(str(exc))]
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        frames.append((frame.f_code.co_filename, tb.tb_lineno, frame.f_locals.get("self")))
        tb = tb.tb_next
    paths = {id(m): name for name, m in model.named_modules()}
    for filename, line, owner in reversed(frames):
        name = _module_at(model, filename, line)
        if name is not None:  # the module running that code, when the frame still tells
            exact = paths.get(id(owner))
            if exact is None or type(owner) is not type(model.get_submodule(name)):
                exact = name
            return exact, filename, line
    return None


def opaque_reason(model: torch.nn.Module, exc: BaseException) -> str:
    """Why a module is kept opaque: torch's message, short, and where."""
    text = first_line(exc).split(" (unhinted")[0]
    site = _failure_site(model, exc)
    return f"{text} at {site[1]}:{site[2]}" if site else text


def failing_submodule(model: torch.nn.Module, exc: BaseException) -> str | None:
    """The submodule (never the root) whose own code stopped the capture, if one did; None
    when the batch size could not be dynamic (then static shapes are tried instead)."""
    if type(exc).__name__ == "ConstraintViolationError" or "Constraints violated" in str(exc):
        return None
    site = _failure_site(model, exc)
    return site[0] if site is not None and site[0] else None


def capture_error(model: torch.nn.Module, tool: str, exc: BaseException, alternative: str,
                   opaque: Mapping[str, Any] | None = None) -> CaptureError:
    """A CaptureError naming the module whose code failed, with the hints that apply."""
    site = _failure_site(model, exc)
    where = ""
    if site is not None:
        name, filename, line = site
        where = (f" in module {name or '<root>'!r} ({type(model.get_submodule(name)).__name__})"
                 f" at {filename}:{line}")
    text = str(exc)
    hints = []
    if "data-dependent" in text or "DataDependent" in type(exc).__name__:
        hints.append("branch on tensor values with torch.where or torch.cond instead of Python "
                     "`if`" + (" (the root module's own code cannot be kept opaque: move that "
                               "code into a submodule)" if site and not site[0] else ""))
    elif alternative:
        hints.append(f"try {alternative}")
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) or "Cache" in text:
        hints.append("build the model with use_cache=False (a KV cache cannot be captured)")
    if not hints:
        hints.append("make that code traceable by torch.export (no untraceable calls)")
    if opaque:
        hints.append(f"already kept opaque: {', '.join(opaque)}")
    if getattr(exc, "pipecompile_details", ""):
        hints.append("compile(..., verbose=True) shows torch's own output")
    error = CaptureError(
        f"{tool} could not capture {type(model).__name__}{where}: {first_line(exc)}. "
        + "; ".join(hints) + ".")
    error.details = getattr(exc, "pipecompile_details", "")  # type: ignore[attr-defined]
    return error


def _module_at(model: torch.nn.Module, filename: str, line: int) -> str | None:
    """Path of the deepest submodule whose forward's source contains filename:line."""
    best = None
    for name, module in model.named_modules():
        try:
            forward = type(module).forward
            src, start = inspect.getsourcelines(forward)
            if inspect.getsourcefile(forward) == filename and start <= line < start + len(src):
                if best is None or name.count(".") >= best.count("."):
                    best = name
        except (OSError, TypeError):
            continue
    return best
