"""A stage graph's forward with direct calls: what a training forward runs instead of the
GraphModule's own `forward`, the same ATen ops in the same order.

torch.fx's forward of a captured graph reads every parameter through a chain of
`Module.__getattr__` calls (`getattr(self.layers, "0").ln1.weight`: about 1 us each) and calls
every op through its `OpOverload` (a Python frame, then a schema-generic argument parser: 0.3 to
1.2 us more than torch's generated binding of the same op). On small stages that is most of the
forward: a 4-layer d=16 GPT stage (94 ops, 52 parameters) ran its no-grad forward in 613-647 us
as a GraphModule, 460-475 us as the eager model and 291-327 us with direct calls (one thread).

`direct_forward(graph_module)` emits the graph again (torch.fx's own code generator, on a copy)
with two changes:

- a parameter or buffer is read from its owning module's `_parameters` / `_buffers` dict,
  bound once (the live dict: `load_state_dict`, `to_empty` and FSDP replace entries in it);
- an `OpOverload` is called through torch's Python binding of the same ATen function, with
  every schema argument explicit, where that binding can only resolve to this overload
  (runtime/op_binding.py: a binding's own defaults are not always the schema's), else through
  the overload's own C++ entry point (what `OpOverload.__call__` calls).

The result is only valid while the graph's code and the modules that own its tensors are the
ones it was emitted from: `DirectForward.valid()` checks that (the stage worker asks once per
training step), and a module with hooks is always called as a module (`plain_call`).
"""

from __future__ import annotations

import functools
import itertools
import linecache
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.nn.modules import module as nn_module

from .op_binding import direct_call

__all__ = ["DirectCalls", "DirectForward", "direct_forward", "plain_call"]

_COUNT = itertools.count()

class _Call(functools.partial):
    """A named callable fx can emit as a global (`aten_index_Tensor(x, [i])`, `read_w()`)."""


def _named(fn: Callable, *args: Any, module: str, name: str) -> _Call:
    call = _Call(fn, *args)
    call.__module__ = module  # fx names the global `<module>_<name>`
    call.__name__ = call.__qualname__ = name  # type: ignore[attr-defined]
    return call


@functools.lru_cache(maxsize=None)
def _named_call(fn: Callable, op: torch._ops.OpOverload) -> _Call:
    """`fn` (`op`'s binding or entry point) as the emitted code calls it, named after `op`
    (`aten_linear_default`): held by object, since fx would emit a torch binding by its public
    name, which for some ops is a Python wrapper with other arguments (`torch.split`)."""
    ns, name = op._schema.name.split("::", 1)
    overload = op._schema.overload_name or "default"
    return _named(fn, module=ns, name=f"{name}_{overload}")


@dataclass(frozen=True)
class _Read:
    """A tensor the graph reads: from `table` (its owner's `_parameters` or `_buffers`)."""

    owner_path: str
    owner: torch.nn.Module
    table: dict
    name: str


@dataclass
class DirectForward:
    """The emitted forward of one GraphModule: `fn(*inputs)` is `module(*inputs)`."""

    module: torch.nn.Module
    code: str  # the GraphModule's own code it was emitted from
    reads: tuple[_Read, ...]
    source: str
    fn: Callable[..., Any]

    def valid(self) -> bool:
        """Whether the graph's code and every tensor owner are still the emitted-from ones."""
        module = self.module
        if getattr(module, "_code", None) is not self.code:
            return False
        owners: dict[str, bool] = {}
        for read in self.reads:
            if read.owner_path not in owners:
                try:
                    owners[read.owner_path] = module.get_submodule(read.owner_path) is read.owner
                except AttributeError:
                    return False
            if not owners[read.owner_path] or read.table.get(read.name) is None:
                return False
            if read.table is not read.owner._parameters and read.table is not read.owner._buffers:
                return False
        return True


_KEEP = 8  # modules whose direct forwards one stage keeps (train, eval, deferred-linear graphs)


@dataclass
class DirectCalls:
    """One stage's training forwards: each module it runs called through its direct forward,
    emitted on first use and checked once per step (`valid`); a module with hooks, or one
    that is not a GraphModule, is called as a module."""

    label: str  # names the emitted code in tracebacks, e.g. "stage 3"
    _known: dict[int, tuple[Any, int, DirectForward | None]] = field(default_factory=dict)

    def __deepcopy__(self, memo: dict) -> "DirectCalls":
        # a copy starts empty: the emitted code reads the original's parameter dicts
        return DirectCalls(self.label)

    def __getstate__(self) -> dict:
        return {"label": self.label, "_known": {}}

    def __call__(self, module: torch.nn.Module, args: Sequence[Any], step: int) -> Any:
        if not plain_call(module):
            return module(*args)
        known = self._known.get(id(module))
        if known is None or known[0] is not module or known[1] != step:
            direct = known[2] if known is not None and known[0] is module else None
            if direct is None or not direct.valid():
                direct = direct_forward(module, self.label)
            if len(self._known) >= _KEEP:
                self._known.clear()
            known = self._known[id(module)] = (module, step, direct)
        direct = known[2]
        return module(*args) if direct is None else direct.fn(*args)


def direct_forward(module: torch.nn.Module, label: str) -> DirectForward | None:
    """The direct-call forward of a GraphModule (`label` names it in tracebacks), or None for
    any other module (a compiled stage, an opaque one)."""
    if not isinstance(module, torch.fx.GraphModule):
        return None
    graph = torch.fx.Graph()
    values: dict = {}
    graph.output(graph.graph_copy(module.graph, values))
    graph._codegen = module.graph._codegen
    reads = []
    for node in graph.nodes:
        if node.op == "get_attr":
            read = _reader(module, node.target)
            if read is not None:
                reads.append(read)
                node.op, node.args, node.kwargs = "call_function", (), {}
                node.target = _named(dict.__getitem__, read.table, read.name, module="read",
                                     name=node.target.replace(".", "_"))
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            fn, node.args, node.kwargs = direct_call(node.target, node.args, node.kwargs)
            node.target = _named_call(fn, node.target)
    code = graph.python_code(root_module="self")
    filename = f"<pipecompile-{next(_COUNT)}: {label}, direct forward>"
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)  # noqa: S102 - fx's code of our graph
    direct = DirectForward(module, module._code, tuple(reads), code.src,
                           functools.partial(namespace["forward"], module))
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(True), filename)
    weakref.finalize(direct, linecache.cache.pop, filename, None)
    return direct


def _reader(module: torch.nn.Module, target: str) -> _Read | None:
    """Where `module.<target>` lives: a parameter or buffer of some submodule (else None:
    a plain attribute, such as a submodule a higher-order op calls, is read as fx reads it)."""
    path, _, name = target.rpartition(".")
    owner = module.get_submodule(path)
    for table in (owner._parameters, owner._buffers):
        if table.get(name) is not None:
            return _Read(path, owner, table, name)
    return None


def plain_call(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs only its forward: no hooks of its own or global ones and
    no `module.compile()` (the test `Module._call_impl` makes for its own fast path)."""
    return not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module._compiled_call_impl is not None
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)
