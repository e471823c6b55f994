"""Capture: turn an `nn.Module` and example inputs into a flat fx graph (`CapturedModel`).

Two front ends give the same IR:

- ``method="export"`` (default): `torch.export.export` with dim 0 of every tensor input whose
  first dimension is the batch size marked dynamic (`Dim("batch")`), so one graph serves every
  micro-batch size. When the model will not export with a dynamic batch, it is exported again
  with static shapes at the micro-batch size, and a note is logged.
- ``method="fx"``: `torch.fx.symbolic_trace`, then fake-tensor propagation with a symbolic batch
  size to give every node the shape metadata export would have given it.

In both cases the graph is rewritten to take the flattened inputs as placeholders and to return
a flat tuple; pytree specs keep the user's argument and result structures.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .capture_errors import capture_error, failing_submodule, first_line, opaque_reason
from .errors import CaptureError, ConfigError
from .ir import CapturedModel, ValueInfo
from .passes import opaque as opaque_modules
from .passes.inplace import functionalize
from .passes.nodes import preserve_buffers
from .passes.opaque import OpaqueModule
from .rng import seed_random_ops

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["capture", "batch_size_of", "require_module", "seed_captured"]

log = logging.getLogger(__name__)


def batch_size_of(args: tuple, kwargs: Mapping[str, Any]) -> int:
    """The batch size: dim 0 of the first tensor argument (positional first, then keyword)."""
    for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    raise ConfigError(
        "example_inputs/example_kwargs contain no tensor with a batch dimension; pass at least "
        "one tensor whose first dimension is the batch size"
    )


def require_module(model: Any) -> None:
    """Refuse anything but an `nn.Module` before any pass reads its parameters."""
    if isinstance(model, torch.nn.Module):
        return
    kind = type(model).__name__
    if callable(model):
        name = getattr(model, "__qualname__", kind)
        raise ConfigError(
            f"pipecompile compiles a torch.nn.Module, got the {kind} {name!r}; wrap it in a "
            f"module whose forward calls it (class Wrapped(torch.nn.Module): def forward(self, "
            f"*args): return fn(*args)), with the tensors it trains registered on that module "
            f"as nn.Parameters")
    raise ConfigError(f"pipecompile compiles a torch.nn.Module, got {kind} {model!r:.60}; pass "
                      f"the model (an nn.Module) as compile's first argument")


def capture(
    model: torch.nn.Module,
    args: tuple,
    kwargs: Mapping[str, Any] | None = None,
    *,
    method: str = "export",
    static_batch_size: int | None = None,
    opaque: bool = True,
    verbose: bool = False,
    batch_only: bool = False,
    budget: float = 120.0,
) -> CapturedModel:
    """Capture `model(*args, **kwargs)` as a flat graph.

    `static_batch_size` is the batch size to re-capture at if a dynamic batch is impossible
    (the compiler passes the micro-batch size). With `opaque`, a submodule torch.export cannot
    trace is kept as one call (see `passes.opaque`). `verbose` lets torch print what it prints
    while capturing (on failure, a partial graph); otherwise it is kept off the terminal.
    `batch_only` keeps every size but the batch fixed (torch.export traces faster).
    """
    kwargs = dict(kwargs or {})
    require_module(model)
    batch = batch_size_of(args, kwargs)
    if method == "export":
        captured = _capture_export(model, tuple(args), kwargs, batch, static_batch_size,
                                   opaque, verbose, batch_only)
    elif method == "fx":
        captured = _capture_fx(model, tuple(args), kwargs, batch)
    else:
        raise ConfigError(f"capture={method!r} is not a capture method; use 'export' or 'fx'")
    module, rewritten = functionalize(captured.module)
    notes = captured.notes
    if rewritten:
        notes += (f"{len(rewritten)} in-place ops on activations made out-of-place "
                  f"({', '.join(rewritten[:3])}{', ...' if len(rewritten) > 3 else ''})",)
    return replace(
        captured,
        module=module,
        notes=notes,
        parameter_names=tuple(n for n, _ in model.named_parameters()),
        state_keys=tensor_keys(model),
        checkpoint_keys=tuple(model.state_dict(keep_vars=True).keys()),
    )


def tensor_keys(model: torch.nn.Module) -> tuple[str, ...]:
    """The names `model.state_dict()` would have without its hooks: every parameter and
    persistent buffer, in state_dict order, a tied one under each name."""
    keys = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        keys += [dot + n for n, p in module._parameters.items() if p is not None]
        keys += [dot + n for n, b in module._buffers.items()
                 if b is not None and n not in module._non_persistent_buffers_set]
    return tuple(dict.fromkeys(keys))


def seed_captured(captured: CapturedModel, seed: int) -> CapturedModel:
    """`captured` with every random op drawing from a per-micro-batch stream (see `rng`)."""
    module, seeded = seed_random_ops(captured.module, seed)
    note = (f"rng per-microbatch (seed {seed}): {len(seeded)} random ops seeded per micro-batch"
            + (f" ({', '.join(seeded[:3])}{', ...' if len(seeded) > 3 else ''})" if seeded else ""))
    return replace(captured, module=module, notes=captured.notes + (note,))


# ---------------------------------------------------------------------------------------------
# torch.export


def _capture_export(model, args, kwargs, batch, static_batch_size, opaque, verbose,
                    batch_only: bool = False) -> CapturedModel:
    from torch.export import Dim

    notes: list[str] = []
    specs: dict[str, OpaqueModule] = {}
    # Tried in order: every size of a batched input symbolic (sequence lengths too), then the
    # batch alone (`batch_only`: from there), then static shapes. Export specialises sizes 0
    # and 1, so a batch below 2 starts static.
    attempts: list[Any] = ([_dynamic_shapes(model, args, kwargs, batch, Dim("batch"), rest)
                            for rest in ((False,) if batch_only else (True, False))]
                           if batch >= 2 else []) + [None]
    first_error: BaseException | None = None
    while True:
        shapes = attempts[0]
        try:
            ep, calls = _export(model, args, kwargs, shapes, specs, verbose)
            break
        except Exception as exc:  # noqa: BLE001 - every export failure is examined below
            path = failing_submodule(model, exc) if opaque else None
            if path:  # keep every module of that class as one opaque call, capture the rest
                paths = _same_class(model, path)
                if not set(paths) <= set(specs):
                    specs.update(opaque_modules.record(
                        model, args, kwargs, paths, opaque_reason(model, exc), batch))
                    continue
            if shapes is None:
                raise capture_error(model, "torch.export", first_error or exc,
                                     "capture='fx'", specs) from exc
            first_error = first_error or exc
            attempts.pop(0)
            note = (f"export with symbolic input sizes failed ({first_line(exc)}); "
                    + ("only the batch size is symbolic" if attempts[0] is not None
                       else "captured static shapes"))
            log.info("pipecompile: %s", note)
            if attempts[0] is not None:
                continue
            notes.append(note)
            if static_batch_size is not None and static_batch_size != batch:
                args, kwargs = _slice_batch((args, kwargs), batch, static_batch_size)
                batch = static_batch_size
                specs = _rerecord(model, args, kwargs, specs, batch)
    dynamic = shapes is not None

    module = ep.module()
    signature = ep.module_call_graph[0].signature
    graph = _flat_graph(module.graph, drop_guards=True)
    gm = fx.GraphModule(module, graph)
    if specs:
        opaque_modules.restore(gm, specs, calls, model)
        notes.extend(f"opaque module {s.path!r} ({s.type_name}): {s.reason}" for s in
                     specs.values())
    values = _values_from_meta(gm.graph)
    batch_symbol, sizes = _symbols(gm.graph, values, batch) if dynamic else (None, {})
    return CapturedModel(
        size_ranges=_ranges(ep, sizes),
        module=gm,
        in_spec=signature.in_spec,
        out_spec=signature.out_spec,
        input_names=tuple(n.name for n in gm.graph.find_nodes(op="placeholder")),
        output_names=_output_names(gm.graph),
        values=values,
        method="export",
        dynamic_batch=dynamic,
        batch_symbol=batch_symbol,
        example_sizes=sizes,
        captured_batch_size=batch,
        notes=tuple(notes),
    )


def _rerecord(model, args, kwargs, specs, batch) -> dict[str, OpaqueModule]:
    """The opaque modules' shapes again, at another batch size."""
    again: dict[str, OpaqueModule] = {}
    for path, spec in specs.items():
        again.update(opaque_modules.record(model, args, kwargs, [path], spec.reason, batch))
    return again


def _export(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], shapes: Any,
            specs: Mapping[str, OpaqueModule], verbose: bool) -> tuple[ExportedProgram, dict]:
    """torch.export with the opaque modules swapped for custom-op calls; torch's own output
    (a partial graph of up to thousands of lines on failure) kept off the terminal unless
    `verbose`."""
    from torch.export import export

    with opaque_modules.exporting(model, specs) as calls, _quiet(verbose) as out:
        try:
            return export(model, args, kwargs, dynamic_shapes=shapes), dict(calls)
        except Exception as exc:
            exc.pipecompile_details = out.getvalue()  # type: ignore[attr-defined]
            raise


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[io.StringIO]:
    """Collect what torch prints to stderr and logs below ERROR while exporting."""
    buffer = io.StringIO()
    if verbose:
        yield buffer
        return
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buffer):
            yield buffer
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch.export", "torch._export",
                  "torch._dynamo", "torch._subclasses.fake_tensor")


def _same_class(model: torch.nn.Module, path: str) -> list[str]:
    """Every module of `path`'s class that does not lie inside another of them."""
    cls = type(model.get_submodule(path))
    found: list[str] = []
    for name, module in model.named_modules():
        if type(module) is cls and name and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def _dynamic_shapes(model, args, kwargs, batch, dim, rest: bool) -> dict[str, Any]:
    """`dynamic_shapes` keyed by forward's parameter names: dim 0 is `dim` where it is the batch,
    and with `rest` that input's other sizes are `Dim.AUTO` (symbolic where the model allows,
    e.g. a sequence length; export keeps a size the model fixes static without failing)."""
    from torch.export import Dim

    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            return {0: dim, **({k: Dim.AUTO for k in range(1, leaf.dim())} if rest else {})}
        return None

    shapes = {}
    for name, value in bound.arguments.items():
        shapes[name] = pytree.tree_map(spec, value)
    return shapes


def _slice_batch(tree, batch: int, size: int):
    def cut(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            return leaf[:size]
        return leaf

    return pytree.tree_map(cut, tree)


def _flat_graph(graph: fx.Graph, *, drop_guards: bool) -> fx.Graph:
    """A copy of `graph` with plain codegen, no export guard calls and a flat tuple output."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "call_module" and drop_guards and node.target == "_guards_fn":
            continue
        if node.op == "output":
            flat = pytree.tree_leaves(node.args[0], is_leaf=lambda x: isinstance(x, fx.Node))
            new.output(tuple(env[x] if isinstance(x, fx.Node) else x for x in flat))
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    new.lint()
    return new


def _values_from_meta(graph: fx.Graph) -> dict[str, ValueInfo]:
    values = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        values[node.name] = value_info(node.name, node.meta.get("val"))
    return values


def value_info(name: str, val: Any) -> ValueInfo:
    """ValueInfo of a node's `meta['val']` (a FakeTensor, SymInt, or anything else)."""
    if isinstance(val, torch.Tensor):
        return ValueInfo(name, tuple(_expr(d) for d in val.shape), val.dtype)
    if isinstance(val, torch.SymInt):
        return ValueInfo(name, (), None)
    return ValueInfo(name, (), None)


def _expr(d: Any) -> Any:
    if isinstance(d, torch.SymInt):
        return d.node.expr
    return int(d)


def _symbols(graph: fx.Graph, values, batch: int) -> tuple[sympy.Symbol | None, dict]:
    """The batch size's symbol, and every symbol's example value (from the shape env hints)."""
    batch_symbol = None
    for node in graph.find_nodes(op="placeholder"):
        info = values[node.name]
        if info.shape and isinstance(info.shape[0], sympy.Symbol):
            batch_symbol = info.shape[0]
            break
    sizes: dict[sympy.Symbol, int] = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d in val.shape:
                if isinstance(d, torch.SymInt):
                    for sym in d.node.expr.free_symbols:
                        env = d.node.shape_env
                        hints = getattr(env, "backed_var_to_val", None) or env.var_to_val
                        hint = hints.get(sym)
                        if hint is not None:
                            sizes[sym] = int(hint)
    if batch_symbol is not None:
        sizes[batch_symbol] = batch
    return batch_symbol, sizes


def _ranges(ep: ExportedProgram, sizes: Mapping[sympy.Symbol, int]
            ) -> dict[sympy.Symbol, tuple[int, int | None]]:
    """The range export assumed for each size symbol, where it is narrower than any size."""
    ranges = {}
    for symbol, vr in ep.range_constraints.items():
        if symbol not in sizes:
            continue
        low = _finite(vr.lower) or 0
        high = _finite(vr.upper)
        if low > 2 or high is not None:  # export's own floor (0 or 2) needs no check
            ranges[symbol] = (low, high)
    return ranges


def _finite(bound: Any) -> int | None:
    """A value range's bound as an int; None for an infinite one (sympy's or torch's int_oo)."""
    return None if "oo" in str(bound) else int(bound)


def _output_names(graph: fx.Graph) -> tuple[str, ...]:
    out = graph.find_nodes(op="output")[0]
    return tuple(x.name if isinstance(x, fx.Node) else repr(x) for x in out.args[0])


# ---------------------------------------------------------------------------------------------
# torch.fx.symbolic_trace


def _capture_fx(model, args, kwargs, batch) -> CapturedModel:
    try:
        traced = fx.symbolic_trace(model)
    except Exception as exc:  # noqa: BLE001
        raise capture_error(model, "torch.fx.symbolic_trace", exc, "capture='export'") from exc

    # Bind the call to forward's parameters: fx placeholders are those parameters, in order.
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    flat_args = tuple(bound.arguments[p.target.lstrip("*")] for p in placeholders)
    in_spec = pytree.tree_flatten((flat_args, {}))[1]

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in traced.graph.nodes:
        if node.op == "output":
            flat, out_spec = pytree.tree_flatten(
                node.args[0], is_leaf=lambda x: isinstance(x, fx.Node)
            )
            graph.output(tuple(env[x] if isinstance(x, fx.Node) else x for x in flat))
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    gm = fx.GraphModule(traced, graph)

    dynamic = _propagate_fake(gm, flat_args, batch)
    values = _values_from_meta(gm.graph)
    batch_symbol, sizes = _symbols(gm.graph, values, batch) if dynamic else (None, {})
    return CapturedModel(
        module=gm,
        in_spec=in_spec,
        out_spec=out_spec,
        input_names=tuple(p.name for p in placeholders),
        output_names=_output_names(gm.graph),
        values=values,
        method="fx",
        dynamic_batch=dynamic and batch_symbol is not None,
        batch_symbol=batch_symbol,
        example_sizes=sizes,
        captured_batch_size=batch,
        # Calls through an fx capture always take positional arguments in forward's order.
        notes=("fx capture: inputs are forward's parameters in order",),
    )


def _propagate_fake(gm: fx.GraphModule, flat_args: tuple, batch: int) -> bool:
    """Fill node.meta['val'] with fake tensors whose batch dimension is symbolic if possible."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    for dynamic in (True, False):
        mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

        def fake(x):
            if not isinstance(x, torch.Tensor):
                return x
            dims = [DimDynamic.STATIC] * x.dim()
            if dynamic and x.dim() > 0 and x.shape[0] == batch:
                dims[0] = DimDynamic.DYNAMIC
            ctx = StatelessSymbolicContext(dynamic_sizes=dims)
            return mode.from_tensor(x, symbolic_context=ctx)

        try:
            fakes = [pytree.tree_map(fake, a) for a in flat_args]
            with preserve_buffers(gm):  # real buffers would see in-place BatchNorm updates
                FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
            return dynamic
        except Exception as exc:  # noqa: BLE001
            if not dynamic:
                raise CaptureError(
                    f"torch.fx traced the model but its graph cannot run on example inputs: "
                    f"{first_line(exc)}. Check example_inputs against forward()'s signature."
                ) from exc
            log.info("pipecompile: symbolic batch propagation failed (%s)", first_line(exc))
    return False
