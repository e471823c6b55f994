"""opaque_causes: modules torch.export captures wrongly or refuses without saying where.

Two kinds of code make capture keep a module opaque (`passes.opaque`) although export does
not stop in it with a traceback through the model:

- **Custom autograd Functions.** torch.export traces *through* `Function.apply`: the graph
  holds the forward's ops and autograd differentiates those, not the Function's own
  `backward`. A reversible residual layer (forward under `no_grad`, backward recomputing the
  inputs) then has no gradient path at all ("element 0 of tensors does not require grad" at
  the first backward); a straight-through estimator would get zero gradients. While export
  runs, `watching_functions` records which module applied a Function (the innermost module
  on the Python stack), so that module runs eagerly, with the Function's own backward.
- **Writes through `.data`.** `self.weight.data.clamp_(...)` in train mode: export fails after
  tracing ("fake tensor in the exported program constant's list") with no frame of the model
  on the stack. `data_writes` runs the model once eagerly and records which module reads or
  sets a parameter's or buffer's `.data`, and where; `data_kept` runs the model with those
  writes going to copies (analysis runs must not change the weights). The module recorded is
  one that is *called* (its forward runs): code in another method (Gemma3n's
  `self.altup.predict(x)`, called by the decoder layer's forward) is charged to the innermost
  called module around it, since only a called module can be kept opaque.

    watching_functions(model, found)   while active: found[path] = why, per Function applied
    data_writes(model, args, kwargs)   {module path: why} for each `.data` use
    data_kept(model)                   while active: `.data` of the model's tensors is a copy
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import Any, Iterator, Mapping

import torch
from torch.autograd.function import Function
from torch.overrides import TorchFunctionMode

from .blame import frame_site, module_paths
from ..ir.nodes import preserve_buffers

__all__ = ["watching_functions", "data_writes", "data_kept"]

_APPLY = Function.__dict__["apply"].__func__  # torch's own Function.apply
_WATCHERS: dict[int, tuple[dict[int, str], dict[str, str]]] = {}  # thread -> (paths, found)
_LOCK = threading.Lock()


@contextlib.contextmanager
def watching_functions(model: torch.nn.Module, found: dict[str, str]) -> Iterator[None]:
    """Record in `found` each module of `model` that applies a custom autograd Function in this
    thread while active (its path -> 'custom autograd.Function Name at file:line')."""
    me = threading.get_ident()
    with _LOCK:
        if not _WATCHERS:
            Function.apply = classmethod(_watched_apply)  # type: ignore[method-assign,assignment]
        _WATCHERS[me] = (module_paths(model), found)
    try:
        yield
    finally:
        with _LOCK:
            del _WATCHERS[me]
            if not _WATCHERS:
                Function.apply = classmethod(_APPLY)  # type: ignore[method-assign,assignment]


def _watched_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    watcher = _WATCHERS.get(threading.get_ident())
    if watcher is not None:
        paths, found = watcher
        site = frame_site(paths, _stack(sys._getframe(1)))
        if site is None:  # applied by no module's code (a hook?): the root answers for it
            found.setdefault("", f"applies the custom autograd.Function {cls.__qualname__} "
                                 f"outside any module's code")
        else:
            found.setdefault(site[0], f"custom autograd.Function {cls.__qualname__} at "
                                      f"{site[1]}:{site[2]} (kept with its own backward)")
    return _APPLY(cls, *args, **kwargs)


def _stack(frame: types.FrameType | None) -> Iterator[tuple[types.FrameType, int]]:
    while frame is not None:
        yield frame, frame.f_lineno
        frame = frame.f_back


# ---------------------------------------------------------------------------------------------
# .data


_DATA = torch._C.TensorBase.__dict__["data"]  # the descriptor behind `tensor.data`


class _DataUse(TorchFunctionMode):
    """`.data` of the watched tensors reads a copy and sets nothing; each use is recorded."""

    def __init__(self, model: torch.nn.Module, record: bool) -> None:
        super().__init__()
        self.tensors = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.paths = module_paths(model) if record else {}
        self.found: dict[str, str] = {}
        self.calling: list[str] = []  # paths of the modules whose forward is running

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if getattr(func, "__self__", None) is _DATA and id(args[0]) in self.tensors:
            if self.paths:
                self._record(self.tensors[id(args[0])])
            if func.__name__ == "__get__":
                return args[0].detach().clone()
            return None  # __set__: the model's tensor keeps its value
        return func(*args, **(kwargs or {}))

    def _record(self, name: str) -> None:
        site = frame_site(self.paths, _stack(sys._getframe(2)))
        if site is None:
            return
        path = next((c for c in reversed(self.calling)
                     if c == site[0] or not c or site[0].startswith(c + ".")), site[0])
        method = "" if path == site[0] else f" (in {site[0]!r}, not through its forward)"
        self.found.setdefault(path, (
            f"uses the .data of {name!r} at {site[1]}:{site[2]}{method} (torch.export cannot "
            f"capture writes through .data)"))

    @contextlib.contextmanager
    def tracking_calls(self, model: torch.nn.Module) -> Iterator[None]:
        """While active, `self.calling` is the stack of the model's modules being called."""
        def pre(path: str) -> Any:
            return lambda *_: self.calling.append(path)

        def post(*_: Any) -> None:
            self.calling.pop()

        handles = [h for name, module in model.named_modules()
                   for h in (module.register_forward_pre_hook(pre(name)),
                             module.register_forward_hook(post))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def data_writes(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]
                ) -> dict[str, str]:
    """{module path: why} for every module whose code uses `.data` of the model's parameters
    or buffers on this input (one eager run; the model's tensors are left as they were)."""
    mode = _DataUse(model, record=True)
    with preserve_buffers(model), torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            with mode, mode.tracking_calls(model):
                model(*args, **kwargs)
        except Exception:  # noqa: BLE001 - what was found before the failure still counts
            pass
    return mode.found


@contextlib.contextmanager
def data_kept(model: torch.nn.Module) -> Iterator[None]:
    """While active, `.data` of the model's parameters and buffers reads a copy and setting it
    does nothing: an analysis run leaves the weights alone."""
    with _DataUse(model, record=False):
        yield
