"""opaque: keep an untraceable submodule as one call in the captured graph.

A mixture-of-experts layer that routes with `nonzero()` and loops over the experts it hit stops
torch.export ("Could not guard on data-dependent expression"). Capture then keeps every module
of that class as an opaque call and exports the rest:

    record(model, args, kwargs, paths)   one eager run of the model: each opaque module's input
                                         and output shapes (how output dims follow input dims)
                                         and its forward FLOPs per sample (FlopCounterMode)
    exporting(model, specs)              during export, those modules' forwards call the custom
                                         op `pipecompile::opaque`, whose fake kernel returns
                                         tensors of the recorded shapes
    restore(gm, specs, calls, model)     each op node becomes one `call_module` node of (a
                                         shallow copy of) the original module returning its
                                         result flat: the graph runs it eagerly, gradients are
                                         exact and its parameters keep their original names

On fake tensors (cost annotation) the module returns outputs of the recorded shapes and charges
its measured forward FLOPs; its real cost is measured with `profile=True`.

The recorded run also notes whether the module drew random numbers (`random`: PhiMoE's router
jitter): with rng="per-microbatch", `ir.rng.seed_random_ops` then runs it on a per-micro-batch
stream of its own, as it runs the captured random ops.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import OpaqueModuleError
from ..ir.nodes import preserve_buffers
from ..ir.rng import draws_random, module_seed, seeded_call
from .opaque_causes import data_kept

__all__ = ["OpaqueModule", "record", "exporting", "restore", "flat_outputs"]

Dim = tuple  # ("in", leaf, dim) or ("const", size)


@dataclass(frozen=True)
class OpaqueModule:
    """One submodule kept as an opaque call: where, what, why, and its recorded shapes."""

    path: str
    type_name: str
    reason: str
    outputs: tuple[tuple[tuple[Dim, ...], torch.dtype], ...]  # per output leaf: dims, dtype
    batch: tuple[int, int] | None  # (input leaf, dim) holding the batch size
    flops_per_sample: int
    out_spec: Any = None  # pytree spec of the module's result
    nones: tuple[int, ...] = ()  # positions of the result's leaves that are None (not tensors)
    random: bool = False  # whether its recorded run drew random numbers

    def __repr__(self) -> str:
        return f"OpaqueModule({self.path!r}, {self.type_name}: {self.reason})"


def record(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any],
           paths: Sequence[str], reason: str, batch: int) -> dict[str, OpaqueModule]:
    """Run `model` once eagerly and record each module at `paths` (shapes, FLOPs)."""
    from ..passes.flops import flop_counter

    seen: dict[str, tuple] = {}
    counter = flop_counter()
    draws = _Draws()
    start: dict[str, tuple[int, int]] = {}

    def pre(path):
        def hook(module, a, kw):
            start[path] = (counter.get_total_flops(), draws.count)
        return hook

    def post(path):
        def hook(module, a, kw, out):
            if path not in seen:
                flops, drawn = start[path]
                seen[path] = ((a, kw), out, counter.get_total_flops() - flops,
                              draws.count > drawn)
        return hook

    handles = []
    for path in paths:
        sub = model.get_submodule(path)
        handles.append(sub.register_forward_pre_hook(pre(path), with_kwargs=True))
        handles.append(sub.register_forward_hook(post(path), with_kwargs=True))
    try:
        with preserve_buffers(model), torch.random.fork_rng(devices=[]), torch.no_grad(), \
                data_kept(model), counter, draws:
            model(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise OpaqueModuleError(
            f"the model does not run eagerly on the example inputs either: {exc}. Check "
            f"example_inputs against forward()'s signature") from exc
    finally:
        for h in handles:
            h.remove()
    specs = {}
    for path in paths:
        if path not in seen:
            continue  # not called on this input: export will not reach it either
        inputs, out, flops, random = seen[path]
        leaves = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
        flat, out_spec = pytree.tree_flatten(out)
        specs[path] = OpaqueModule(
            path, type(model.get_submodule(path)).__name__, reason,
            _output_rules(leaves, flat, path), _batch_dim(leaves, batch),
            flops // max(batch, 1), out_spec, tuple(i for i, x in enumerate(flat) if x is None),
            random)
    return specs


class _Draws(TorchDispatchMode):
    """Counts the ops that draw random numbers (`ir.rng.draws_random`)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        self.count += draws_random(func, args, kwargs)
        return func(*args, **kwargs)


def _output_rules(leaves: list[torch.Tensor], flat: list, path: str) -> tuple:
    """Per tensor of the result: how its dims follow the inputs', and its dtype. None (an
    optional output left out, as in transformers' ModelOutputs) stays None."""
    rules = []
    for leaf in flat:
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            raise OpaqueModuleError(
                f"module {path!r} returns a {type(leaf).__name__}; an opaque module must return "
                f"tensors (or None) only. Make that module traceable (no branching on tensor "
                f"values)")
        rules.append((tuple(_dim_rule(leaves, k, d) for k, d in enumerate(leaf.shape)),
                      leaf.dtype))
    return tuple(rules)


def _dim_rule(leaves: list[torch.Tensor], k: int, size: int) -> Dim:
    """An output dim follows an input dim of the same size (the same index first)."""
    for i, t in enumerate(leaves):
        if k < t.dim() and t.shape[k] == size:
            return ("in", i, k)
    for i, t in enumerate(leaves):
        for j, s in enumerate(t.shape):
            if s == size:
                return ("in", i, j)
    return ("const", int(size))


def _batch_dim(leaves: list[torch.Tensor], batch: int) -> tuple[int, int] | None:
    for i, t in enumerate(leaves):
        if t.dim() > 0 and t.shape[0] == batch:
            return (i, 0)
    return None


# ---------------------------------------------------------------------------------------------
# the custom op seen by torch.export

_ACTIVE: dict[str, OpaqueModule] = {}  # path -> spec, only while `exporting` runs
_TENSOR = object()  # where an opaque call's input leaves hold a tensor (None is an input too)


@torch.library.custom_op("pipecompile::opaque", mutates_args=())
def _opaque(path: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raise AssertionError("pipecompile::opaque only runs on fake tensors during capture")


@_opaque.register_fake
def _opaque_fake(path: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return fake_outputs(_ACTIVE[path], inputs)


def fake_outputs(spec: OpaqueModule, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors of the recorded output shapes, sized from `inputs` (fake or symbolic)."""
    outs = []
    for dims, dtype in spec.outputs:
        shape = [inputs[d[1]].shape[d[2]] if d[0] == "in" else d[1] for d in dims]
        outs.append(inputs[0].new_empty(shape, dtype=dtype))
    return outs


@contextlib.contextmanager
def exporting(model: torch.nn.Module, specs: Mapping[str, OpaqueModule]) -> Iterator[dict]:
    """While active, each module at a path in `specs` calls `pipecompile::opaque` instead.

    Yields {path: (input spec, input leaves with `_TENSOR` where a tensor goes)} for
    `restore`."""
    patched: list[tuple[torch.nn.Module, bool, Any]] = []  # (module, had own forward, that)
    calls: dict[str, tuple] = {}
    for path, spec in specs.items():
        module = model.get_submodule(path)

        def forward(*args, _path=path, _spec=spec, **kwargs):
            leaves, in_spec = pytree.tree_flatten((args, kwargs))
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            calls[_path] = (in_spec, [_TENSOR if isinstance(x, torch.Tensor) else x
                                      for x in leaves])
            flat = list(torch.ops.pipecompile.opaque(_path, tensors))
            for i in _spec.nones:
                flat.insert(i, None)
            return pytree.tree_unflatten(flat, _spec.out_spec)

        had = "forward" in module.__dict__
        patched.append((module, had, module.__dict__.get("forward")))
        module.forward = forward
        _ACTIVE[path] = spec
    try:
        yield calls
    finally:
        for module, had, old in patched:
            if had:
                module.forward = old
            else:
                del module.forward
        for path in specs:
            _ACTIVE.pop(path, None)


# ---------------------------------------------------------------------------------------------
# back to a module call


def flat_outputs(result: Any) -> tuple:
    """The tensors of an opaque module's result, flat: what its call returns in the graph."""
    return tuple(x for x in pytree.tree_leaves(result) if x is not None)


def restore(gm: fx.GraphModule, specs: Mapping[str, OpaqueModule], calls: Mapping[str, tuple],
            model: torch.nn.Module) -> None:
    """Replace every `pipecompile::opaque` node of `gm` by a call of the original module."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.pipecompile.opaque.default:
            continue
        path, tensors = node.args[0], list(node.args[1])
        in_spec, leaves = calls[path]
        leaves = [tensors.pop(0) if x is _TENSOR else x for x in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, in_spec)
        with graph.inserting_before(node):
            call = graph.call_module(path, tuple(args), dict(kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
        _install(gm, path, _opaque_copy(model.get_submodule(path), specs[path]))
    graph.lint()
    gm.recompile()


def _install(gm: fx.GraphModule, path: str, module: torch.nn.Module) -> None:
    parent: torch.nn.Module = gm
    *prefix, name = path.split(".")
    for part in prefix:
        if not hasattr(parent, part):
            parent.add_module(part, torch.nn.Module())
        parent = getattr(parent, part)
    setattr(parent, name, module)


def _opaque_copy(module: torch.nn.Module, spec: OpaqueModule) -> torch.nn.Module:
    """A shallow copy (same parameters, buffers and children) whose forward returns its result
    flat, and answers fake tensors with the recorded shapes (cost annotation runs it).

    The copy's class is a subclass of the module's own: `copy.copy` (eval mode) keeps working."""
    cls = type(module)
    opaque_cls = type(cls.__name__, (cls,), {
        "forward": _opaque_forward, "_pipecompile_opaque": spec,
        "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    clone = copy.copy(module)
    clone.__class__ = opaque_cls
    return clone


def _opaque_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple:
    """The module's own forward on real tensors; recorded shapes on fake ones."""
    from torch._subclasses.fake_tensor import FakeTensor

    spec: OpaqueModule = getattr(type(self), "_pipecompile_opaque")  # see _opaque_copy
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not any(isinstance(t, FakeTensor) for t in tensors):
        # type(self) is the opaque subclass: super() reaches the module's own forward, which
        # mypy cannot see from `self: Module`
        own = super(type(self), self).forward  # type: ignore[misc]
        seed = module_seed(self)
        if seed is not None:  # rng="per-microbatch": on this module's stream (ir.rng)
            return flat_outputs(seeded_call(own, f"module:{spec.path}", seed, *args, **kwargs))
        return flat_outputs(own(*args, **kwargs))
    _charge(spec, tensors)
    return tuple(fake_outputs(spec, tensors))


def _charge(spec: OpaqueModule, tensors: list[torch.Tensor]) -> None:
    """Make a FlopCounterMode that is watching count the measured forward FLOPs: one
    (batch, k) x (k, 1) matmul, 2·batch·k FLOPs."""
    k = spec.flops_per_sample // 2
    if k <= 0 or spec.batch is None:
        return
    batch = tensors[spec.batch[0]].shape[spec.batch[1]]
    a = tensors[0].new_empty((batch, k), dtype=torch.float32)
    torch.mm(a, a.new_empty((k, 1)))
