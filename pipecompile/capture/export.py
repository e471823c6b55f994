"""The torch.export front end of capture: attempts, and what each failure makes opaque.

Attempts, in order (`sizes` says where to start):

    "all":   every size of a batched input symbolic (sequence lengths, image sizes),
             bounded: run first in a child process killed at `budget` seconds (`bounded.py`)
    "batch": the batch alone symbolic
    static:  no symbolic size, at the micro-batch size

Export specialises sizes 0 and 1, so a batch below 2 starts static. Only the "all" attempt can
run away (a MaxViT-style model's block/grid partition reshapes keep sympy busy for over 15
minutes with every size symbolic, against seconds with the batch alone), so only it is bounded:
its child is killed at the budget, the next attempt runs, and a note says so (`explain()`).
When the child finished in time, this process exports itself (the same deterministic work).
The batch-only and static attempts trace the model once each, with no sizes to reason about.
No exception is ever raised into a thread from outside.

Within an attempt, what makes capture keep a module opaque (`passes.opaque`) and export again:

    a custom autograd.Function applied     (always; the module that applied it, every time)
    export stopped in a submodule's code   (a data-dependent branch: `failing_submodule`)
    .data of a parameter used in a module  (found by one eager run when export names no frame)

The root module cannot be opaque: a Function applied or `.data` used in its own forward is a
`CaptureError` naming it (move that code into a submodule).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any, Mapping

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .blame import (
    batch_constraint,
    capture_error,
    failing_submodule,
    failure_site,
    first_line,
    opaque_reason,
)
from .graph import (drop_body_checks, flat_graph, output_names, ranges, symbols,
                    values_from_meta)
from .bounded import Outcome, finishes_within
from ..errors import CaptureError
from ..ir.records import CapturedModel
from . import opaque as opaque_modules, unbacked
from .opaque import OpaqueModule
from .opaque_causes import data_writes, watching_functions
from .quiet import quiet as _quiet

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["capture_export"]

log = logging.getLogger(__name__)

SIZES = ("all", "batch")  # capture_export(sizes=...): the first attempt's symbolic sizes


class TimeUp(Exception):
    """A bounded export attempt did not finish within its budget (or its child died)."""

    def __init__(self, seconds: float, outcome: Outcome) -> None:
        super().__init__(f"did not finish within {seconds:g} s" if outcome is Outcome.TIMED_OUT
                         else f"its bounded attempt {outcome.value} in the child process")
        self.seconds, self.outcome = seconds, outcome


def capture_export(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], batch: int, *,
                   static_batch_size: int | None, opaque: bool, verbose: bool, sizes: str,
                   budget: float) -> CapturedModel:
    """`model(*args, **kwargs)` captured by torch.export (see the module docstring); `sizes`
    is "all" (every size symbolic first, bounded by `budget` seconds) or "batch"."""
    from torch.export import Dim

    assert sizes in SIZES, sizes
    notes: list[str] = []
    specs: dict[str, OpaqueModule] = {}
    firsts = ((("every input size symbolic", True),) if sizes == "all" else ()) + (
        ("only the batch symbolic", False),)
    attempts: list[tuple[str, Any, bool]] = ([
        (label, _dynamic_shapes(model, args, kwargs, batch, Dim("batch"), rest), rest)
        for label, rest in firsts] if batch >= 2 else [])
    attempts.append(("static shapes", None, False))
    first_error: BaseException | None = None
    _warm_up()
    while True:
        label, shapes, bound = attempts[0]
        functions: dict[str, str] = {}  # module path -> the custom Function it applied
        error: BaseException | None = None
        try:
            ep, calls = _export(model, args, kwargs, shapes, specs, verbose,
                                budget if bound else None, functions)
        except Exception as exc:  # noqa: BLE001 - every export failure is examined below
            error = exc
        causes = functions or _causes(model, args, kwargs, error, opaque)
        added = bool(causes) and _keep_opaque(model, args, kwargs, causes, specs, batch, opaque,
                                              error)
        if added and not isinstance(error, TimeUp):  # again, with those modules opaque
            continue
        if error is None:
            break
        if shapes is None:
            raise capture_error(model, "torch.export", first_error or error,
                                "capture='fx'" if _fx_traces(model) else "", specs) from error
        if not isinstance(error, TimeUp):
            first_error = first_error or error
        attempts.pop(0)
        next_label = attempts[0][0]
        if isinstance(error, TimeUp):
            note = (f"export with {label} did not finish within capture_budget={budget:g} s; "
                    f"captured with {next_label}" if error.outcome is Outcome.TIMED_OUT else
                    f"export with {label} was not tried: {error}; captured with {next_label}")
        else:
            note = (f"export with {label} failed ({first_line(error)}); captured with "
                    f"{next_label}")
        log.info("%s", note.replace("; captured with", "; trying"))
        if isinstance(error, TimeUp) or attempts[0][1] is None:
            notes.append(note)
        if attempts[0][1] is None and static_batch_size is not None and static_batch_size != batch:
            args, kwargs = _slice_batch((args, kwargs), batch, static_batch_size)
            batch = static_batch_size
            specs = _rerecord(model, args, kwargs, specs, batch)
    return _captured(model, ep, calls, specs, notes, batch, dynamic=shapes is not None)


def _captured(model: torch.nn.Module, ep: ExportedProgram, calls: dict,
              specs: Mapping[str, OpaqueModule], notes: list[str], batch: int, *,
              dynamic: bool) -> CapturedModel:
    module = ep.module()
    signature = ep.module_call_graph[0].signature
    gm = fx.GraphModule(module, flat_graph(module.graph, drop_guards=True))
    drop_body_checks(gm)
    if specs:
        opaque_modules.restore(gm, specs, calls, model)
        notes = notes + [f"opaque module {s.path!r} ({s.type_name}): {s.reason}"
                         for s in specs.values()]
    values = values_from_meta(gm.graph)
    batch_symbol, sizes = symbols(gm.graph, values, batch) if dynamic else (None, {})
    estimates, estimated = unbacked.estimate(  # data-dependent sizes
        gm.graph, {batch_symbol: sympy.Symbol("batch")} if batch_symbol is not None else {})
    return CapturedModel(
        size_ranges=ranges(ep, sizes),
        estimated_sizes=estimates,
        module=gm,
        in_spec=signature.in_spec,
        out_spec=signature.out_spec,
        input_names=tuple(n.name for n in gm.graph.find_nodes(op="placeholder")),
        output_names=output_names(gm.graph),
        values=values,
        method="export",
        dynamic_batch=dynamic,
        batch_symbol=batch_symbol,
        example_sizes=sizes,
        captured_batch_size=batch,
        notes=tuple(notes) + estimated,
    )


def _causes(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
            error: BaseException | None, opaque: bool) -> dict[str, str]:
    """{module path: why} of the modules `error` asks to keep opaque: the submodule whose code
    stopped export, else (no model frame on the stack) those using `.data` of a tensor."""
    if error is None or isinstance(error, TimeUp) or not opaque:
        return {}
    if "lifted_tensor" in str(error) or (failure_site(model, error) is None
                                         and not batch_constraint(error)):
        found = data_writes(model, args, kwargs)
        if found:
            return found
    path = failing_submodule(model, error)
    return {path: opaque_reason(model, error)} if path else {}


def _keep_opaque(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
                 causes: Mapping[str, str], specs: dict[str, OpaqueModule], batch: int,
                 opaque: bool, error: BaseException | None) -> bool:
    """Add every module of each cause's class to `specs`; False when nothing was new."""
    if "" in causes or not opaque:
        path = "" if "" in causes else next(iter(causes))
        module = model.get_submodule(path)
        raise CaptureError(
            f"torch.export cannot capture {type(model).__name__}: module {path or '<root>'!r} "
            f"({type(module).__name__}) {causes[path]}; "
            + ("move that code into a submodule, which capture then keeps opaque (runs it "
               "eagerly)" if not path else "capture(..., opaque=True) keeps it opaque (runs "
               "it eagerly)") + ".") from error
    reasons: dict[str, str] = {}  # every module of a cause's class, with the cause's reason
    for path, why in causes.items():
        for same in _same_class(model, path):
            reasons.setdefault(same, why)
    paths = [p for p in reasons if not any(p.startswith(q + ".") for q in reasons)]
    new = [p for p in paths if p not in specs]
    for path in list(specs):  # a module inside a new opaque one runs inside it
        if any(path.startswith(p + ".") for p in new):
            del specs[path]
    for path in new:  # (one not called on this input gets no spec)
        specs.update(opaque_modules.record(model, args, kwargs, [path], reasons[path], batch))
    return any(p in specs for p in new)


def _rerecord(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any],
              specs: Mapping[str, OpaqueModule], batch: int) -> dict[str, OpaqueModule]:
    """The opaque modules' shapes again, at another batch size."""
    again: dict[str, OpaqueModule] = {}
    for path, spec in specs.items():
        again.update(opaque_modules.record(model, args, kwargs, [path], spec.reason, batch))
    return again


def _export(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], shapes: Any,
            specs: Mapping[str, OpaqueModule], verbose: bool, budget: float | None,
            functions: dict[str, str]) -> tuple[ExportedProgram, dict]:
    """torch.export, with the opaque modules swapped for custom-op calls, recording in
    `functions` the modules applying a custom autograd Function; torch's own output (a partial
    graph of up to thousands of lines on failure) kept off the terminal unless `verbose`. With
    a `budget`, the export is first run in a child process killed at the budget (`TimeUp`)."""
    from torch.export import export

    with opaque_modules.exporting(model, specs) as calls, _quiet(verbose) as out, \
            watching_functions(model, functions):
        if budget is not None:
            outcome = finishes_within(
                budget, lambda: export(model, args, kwargs, dynamic_shapes=shapes))
            if outcome in (Outcome.TIMED_OUT, Outcome.DIED):
                raise TimeUp(budget, outcome)
            if outcome is Outcome.UNBOUNDED:
                log.warning("no child processes on this platform: export with every input "
                            "size symbolic runs without capture_budget's bound")
        try:
            ep = export(model, args, kwargs, dynamic_shapes=shapes)
        except Exception as exc:
            exc.pipecompile_details = out.getvalue()  # type: ignore[attr-defined]
            raise
        return ep, dict(calls)


_warm = False  # whether this process has exported once (imports done: see _warm_up)


def _warm_up() -> None:
    """Export a one-layer module once per process: torch imports much of itself on the first
    export, which a bounded attempt's child would otherwise do again (inside its budget) every
    time."""
    global _warm
    if not _warm:
        from torch.export import Dim, export

        with _quiet(False):
            export(torch.nn.Linear(2, 2), (torch.zeros(2, 2),),
                   dynamic_shapes=({0: Dim("batch"), 1: Dim.AUTO},))
        _warm = True


def _fx_traces(model: torch.nn.Module) -> bool:
    """Whether torch.fx traces the model (then capture='fx' is worth suggesting)."""
    try:
        fx.symbolic_trace(model)
    except Exception:  # noqa: BLE001 - any failure: fx is no way out
        return False
    return True


def _same_class(model: torch.nn.Module, path: str) -> list[str]:
    """Every module of `path`'s class that does not lie inside another of them."""
    cls = type(model.get_submodule(path))
    found: list[str] = []
    for name, module in model.named_modules():
        if type(module) is cls and name and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], batch: int,
                    dim: Any, rest: bool) -> dict[str, Any]:
    """`dynamic_shapes` keyed by forward's parameter names: dim 0 is `dim` where it is the batch,
    and with `rest` that input's other sizes are `Dim.AUTO` (symbolic where the model allows,
    e.g. a sequence length; export keeps a size the model fixes static without failing)."""
    from torch.export import Dim

    bound = inspect.signature(model.forward).bind(*args, **kwargs)

    def spec(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            return {0: dim, **({k: Dim.AUTO for k in range(1, leaf.dim())} if rest else {})}
        return None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def _slice_batch(tree: Any, batch: int, size: int) -> Any:
    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch:
            return leaf[:size]
        return leaf

    return pytree.tree_map(cut, tree)

