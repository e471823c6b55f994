"""unbacked: a stated estimate for each data-dependent size of a captured graph.

torch.export keeps a size the data decides as an *unbacked* symbol (`u0`, `u1`, ...): JetMoE
routes tokens to its experts with `x.split(counts.tolist())`, so the graph holds
`split_with_sizes(x, [u0, u1, u2, u3])` and every expert's matmul is `u_i` rows long. Cost
expressions then carry those symbols, and no input size binds them. Capture prices each one:

    a size of a split (split_with_sizes)    an even split: the split dimension / number of
                                            pieces, rounded down, the last piece taking the
                                            rest (even routing; the pieces add up, as export's
                                            runtime asserts demand), in the other size
                                            symbols, so it follows the micro-batch size
    any other data-dependent size           1 (nothing to derive it from)

    estimate(graph) -> ({symbol: expression}, notes)

`CapturedModel.sizes_at` and `sizes_of` evaluate the estimates at the sizes of a call. The
notes say what was assumed (`explain()` shows them): the real sizes depend on the data,
and a step's time on a skewed batch may differ from the plan's.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

__all__ = ["estimate"]

_SPLITS = ("split_with_sizes", "split_with_sizes_copy")


def estimate(graph: fx.Graph, names: Mapping[sympy.Symbol, sympy.Symbol] | None = None
             ) -> tuple[dict[sympy.Symbol, sympy.Expr], tuple[str, ...]]:
    """{unbacked symbol: its estimate in the graph's other size symbols} and notes (which
    write a size symbol by its name in `names`, e.g. `batch`)."""
    found: dict[sympy.Symbol, sympy.Expr] = {}
    example = ""
    for node in graph.nodes:
        if not _is_split(node):
            continue
        source, sizes = node.args[0], list(node.args[1])
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        value = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        total = sympy.sympify(_expr(value.shape[dim]))
        share = sympy.floor(total / len(sizes))  # whole rows; the last piece takes the rest,
        for i, size in enumerate(sizes):  # so the pieces add up to what they split
            symbol = _expr(size.meta.get("val")) if isinstance(size, fx.Node) else None
            if isinstance(symbol, sympy.Symbol) and _unbacked(symbol) and symbol not in found:
                found[symbol] = share if i < len(sizes) - 1 else total - (len(sizes) - 1) * share
                shown = total.subs(dict(names or {}))
                example = example or f"{symbol} in {_module(node)!r}: {shown} / {len(sizes)}"
    split = sorted(found, key=str)
    rest = sorted((s for s in _unbacked_in(graph) if s not in found), key=str)
    found.update({s: sympy.Integer(1) for s in rest})
    notes = []
    if split:
        notes.append(
            f"{len(split)} data-dependent sizes ({_names(split)}) priced as even splits of "
            f"what they split (e.g. {example}): an estimate, the real sizes depend on the data")
    if rest:
        notes.append(f"{len(rest)} data-dependent sizes ({_names(rest)}) priced at 1 (nothing "
                     f"to derive them from): an estimate, the real sizes depend on the data")
    return found, tuple(notes)


def _is_split(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.overloadpacket.__name__ in _SPLITS and len(node.args) > 1
            and isinstance(node.args[1], (list, tuple)) and len(node.args[1]) > 0)


def _module(node: fx.Node) -> str:
    """The path of the module whose code made `node` (its op's name if none)."""
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else node.name


def _expr(size: Any) -> Any:
    """A size as a sympy expression (an int as itself)."""
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _unbacked(symbol: sympy.Symbol) -> bool:
    return bool(free_unbacked_symbols(symbol))


def _unbacked_in(graph: fx.Graph) -> Iterator[sympy.Symbol]:
    seen: set[sympy.Symbol] = set()
    for node in graph.nodes:
        value = node.meta.get("val")
        dims = value.shape if isinstance(value, torch.Tensor) else (value,)
        for d in dims:
            if isinstance(d, torch.SymInt):
                for symbol in free_unbacked_symbols(d.node.expr):
                    if symbol not in seen:
                        seen.add(symbol)
                        yield symbol


def _names(symbols: list[sympy.Symbol]) -> str:
    return ", ".join(map(str, symbols[:4])) + (", ..." if len(symbols) > 4 else "")
