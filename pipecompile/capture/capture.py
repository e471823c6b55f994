"""Capture: turn an `nn.Module` and example inputs into a flat fx graph (`CapturedModel`).

Two front ends give the same IR:

- ``method="export"`` (default, export.py): `torch.export.export` with every size of a
  batched input symbolic (dim 0, the batch, as `Dim("batch")`), so one graph serves every
  micro-batch size and sequence length; then the batch alone, then static shapes at the
  micro-batch size, each attempt bounded in time; untraceable submodules kept opaque.
- ``method="fx"``: `torch.fx.symbolic_trace`, then fake-tensor propagation with a symbolic batch
  size to give every node the shape metadata export would have given it.

In both cases the graph is rewritten to take the flattened inputs as placeholders and to return
a flat tuple; pytree specs keep the user's argument and result structures.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .blame import capture_error, first_line
from .claimed_device import claiming, restore_tensors
from .export import capture_export
from .graph import output_names, symbols, values_from_meta
from .reuse import reusing_capture
from ..errors import CaptureError, ConfigError
from ..ir.compile_cache import CompileCache
from ..ir.records import CapturedModel, batch_size_of  # batch_size_of: named here for callers
from ..passes.inplace import functionalize
from ..ir.nodes import preserve_buffers
from ..ir.rng import seed_random_ops

__all__ = ["capture", "batch_size_of", "require_module", "seed_captured"]

log = logging.getLogger(__name__)


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
    sizes: str = "batch",
    budget: float = 120.0,
    cache: CompileCache | None = None,
    claim: torch.device | None = None,
) -> CapturedModel:
    """Capture `model(*args, **kwargs)` as a flat graph.

    `static_batch_size` is the batch size to re-capture at if a dynamic batch is impossible
    (the compiler passes the micro-batch size). With `opaque`, a submodule torch.export cannot
    trace is kept as one call (see `passes.opaque`). `verbose` lets torch print what it prints
    while capturing (on failure, a partial graph); otherwise it is kept off the terminal.
    `sizes="batch"` keeps every size but the batch fixed (torch.export traces fast);
    `sizes="all"` first tries every size symbolic, for at most `budget` seconds in a child
    process (then the batch alone). A `cache` keeping captures (`CompileCache(captures=N)`)
    reuses the graph of a structurally identical model, rebound to this one's tensors
    (reuse.py); by default nothing is reused. With `claim`, a model on the meta device is
    traced on fake tensors claiming that device, its own meta tensors put back in the graph
    after (claimed_device.py).
    """
    kwargs = dict(kwargs or {})
    require_module(model)
    options = (method, static_batch_size, opaque, sizes, budget, str(claim))

    def fresh(args: tuple, kwargs: dict[str, Any]) -> CapturedModel:
        return _capture(model, args, kwargs, method=method, static_batch_size=static_batch_size,
                        opaque=opaque, verbose=verbose, sizes=sizes, budget=budget)

    def claimed() -> CapturedModel:
        assert claim is not None
        with claiming(model, (tuple(args), kwargs), claim) as ((fakes, fake_kwargs), originals):
            traced = fresh(fakes, fake_kwargs)
        return restore_tensors(traced, model, originals, claim)

    captured = reusing_capture(cache, model, tuple(args), kwargs, options,
                               claimed if claim is not None else
                               lambda: fresh(tuple(args), kwargs))
    return replace(  # through the model's own state_dict hooks: never reused
        captured,
        parameter_names=tuple(n for n, _ in model.named_parameters()),
        state_keys=tensor_keys(model),
        checkpoint_keys=tuple(model.state_dict(keep_vars=True).keys()),
    )


def _capture(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], *, method: str,
             static_batch_size: int | None, opaque: bool, verbose: bool, sizes: str,
             budget: float) -> CapturedModel:
    batch = batch_size_of(args, kwargs)
    if method == "export":
        captured = capture_export(model, args, kwargs, batch,
                                  static_batch_size=static_batch_size, opaque=opaque,
                                  verbose=verbose, sizes=sizes, budget=budget)
    elif method == "fx":
        captured = _capture_fx(model, args, kwargs, batch)
    else:
        raise ConfigError(f"capture={method!r} is not a capture method; use 'export' or 'fx'")
    module, rewritten = functionalize(captured.module)
    notes = captured.notes
    if rewritten:
        notes += (f"{len(rewritten)} in-place ops on activations made out-of-place "
                  f"({', '.join(rewritten[:3])}{', ...' if len(rewritten) > 3 else ''})",)
    return replace(captured, module=module, notes=notes)


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
    values = values_from_meta(gm.graph)
    batch_symbol, sizes = symbols(gm.graph, values, batch) if dynamic else (None, {})
    return CapturedModel(
        module=gm,
        in_spec=in_spec,
        out_spec=out_spec,
        input_names=tuple(p.name for p in placeholders),
        output_names=output_names(gm.graph),
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
            log.info("symbolic batch propagation failed (%s)", first_line(exc))
    return False
