"""Each op of a block priced as a GPU runs it: the kernel model of absent devices.

The annotate pass runs a block's ops on fake tensors; for hardware described by its figures it
records, per op, what the device would do (`Recorder`), and prices the block (`Kernels.times`):

    matmul      an op with FLOPs (linear, mm, bmm, conv): the roofline of its shape,
                max(FLOPs / matmul rate, bytes read and written / memory bandwidth)
    attention   scaled_dot_product_attention as one fused kernel (FlashAttention: run here as
                aten._scaled_dot_product_flash_attention, so autograd saves q, k, v, the output
                and the log-sum-exp, O(s), never the s x s scores): FLOPs at the attention rate,
                half of them for a causal mask (the kernel skips the masked blocks)
    memory      every other op that makes a new tensor (norms, softmax, elementwise, the loss):
                its bytes read and written at memory bandwidth
    view        an op whose output shares an input's storage (view, transpose, expand): free

each kernel also paying the device's launch cost. Backward: the counted backward FLOPs at the
block's forward matmul rate (FlashAttention's backward, 2.5x its forward FLOPs, at the
attention rate), and twice the forward's memory traffic and launches. All quantities are sympy
expressions of the captured sizes, evaluated per micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["ATTENTION_OPS", "Kernels", "Recorder", "fused_attention", "is_causal_mask",
           "HardwareRates"]

_aten = torch.ops.aten
#: The attention ops priced as one fused kernel.
ATTENTION_OPS = (_aten.scaled_dot_product_attention.default,)
_COMPARISONS = {_aten.le.Tensor, _aten.lt.Tensor, _aten.ge.Tensor, _aten.gt.Tensor}
#: FlashAttention's backward runs 2.5x its forward FLOPs (recomputes QK^T; dQ, dK, dV, dP).
FLASH_BACKWARD = 2.5


@dataclass(frozen=True)
class HardwareRates:
    """What the kernel model needs of a device: sustained FLOP/s of large matmuls and of fused
    attention, memory bytes/s, seconds per kernel launch."""

    matmul: float
    attention: float
    memory: float
    launch: float = 0.0


@dataclass(frozen=True)
class Kernels:
    """A block's ops as kernels (sympy expressions of the sizes): matmuls as (FLOPs, bytes)
    pairs, attention FLOPs as run (causal: halved) and as counted, memory-bound bytes, and
    the number of kernels launched."""

    matmuls: tuple[tuple[sympy.Expr, sympy.Expr], ...] = ()
    attention: sympy.Expr = sympy.Integer(0)  # FLOPs the fused kernels run (forward)
    attention_counted: sympy.Expr = sympy.Integer(0)  # FLOPs the counter saw (forward)
    memory: sympy.Expr = sympy.Integer(0)  # bytes read + written by memory-bound ops
    launches: int = 0

    def times(self, backward_flops: float, rates: HardwareRates,
              value: Callable[[sympy.Expr], float]) -> tuple[float, float]:
        """(forward, backward) seconds on a device of `rates`; `value` evaluates an expression
        at the micro-batch's sizes; `backward_flops` is the block's counted backward."""
        flops = bytes_ = compute = 0.0
        for f, b in self.matmuls:
            fv, bv = value(f), value(b)
            flops += fv
            bytes_ += bv
            compute += max(fv / rates.matmul, bv / rates.memory)
        rate = flops / compute if compute > 0 else rates.matmul  # the block's matmul rate
        attention = value(self.attention) / rates.attention
        memory = value(self.memory) / rates.memory
        launch = self.launches * rates.launch
        forward = compute + attention + memory + launch
        counted = value(self.attention_counted)
        matmul_backward = max(0.0, backward_flops - FLASH_BACKWARD * counted)
        backward = (matmul_backward / rate + FLASH_BACKWARD * attention + 2 * memory
                    + 2 * launch)
        return forward, backward


@dataclass
class Recorder:
    """Collects the kernels of one block while its ops run on fake tensors (`record` after
    each op with the FLOPs the counter added)."""

    sym: Callable[[Any], sympy.Expr]
    matmuls: list[tuple[sympy.Expr, sympy.Expr]] = field(default_factory=list)
    attention: sympy.Expr = sympy.Integer(0)
    attention_counted: sympy.Expr = sympy.Integer(0)
    memory: sympy.Expr = sympy.Integer(0)
    launches: int = 0

    def record(self, node: fx.Node, args: Any, kwargs: Any, out: Any, flops: Any,
               causal: bool) -> None:
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        if not outputs:
            return
        if node.target in ATTENTION_OPS:
            counted = self.sym(flops)
            self.attention_counted += counted
            self.attention += counted / 2 if causal else counted
            self.launches += 1
            return
        storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
        if all(StorageWeakRef(t.untyped_storage()) in storages for t in outputs):
            return  # a view: no kernel
        moved = sum((self._bytes(t) for t in [*inputs, *outputs]), sympy.Integer(0))
        flops = self.sym(flops)
        if flops != 0:
            self.matmuls.append((flops, moved))
        else:
            self.memory += moved
        self.launches += 1

    def _bytes(self, t: torch.Tensor) -> sympy.Expr:
        return self.sym(t.numel()) * t.element_size()

    def kernels(self) -> Kernels:
        """The block's kernels, repeated shapes merged (a layer's q, k, v projections)."""
        merged: dict[tuple[sympy.Expr, sympy.Expr], int] = {}
        for pair in self.matmuls:
            merged[pair] = merged.get(pair, 0) + 1
        return Kernels(tuple((f * n, b * n) for (f, b), n in merged.items()),
                       sympy.expand(self.attention), sympy.expand(self.attention_counted),
                       sympy.expand(self.memory), self.launches)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, Mapping):
            for y in x.values():
                visit(y)

    visit(value)
    return found


def fused_attention(args: tuple, kwargs: Mapping[str, Any], causal: bool) -> torch.Tensor:
    """scaled_dot_product_attention's output computed by the FlashAttention op, whose autograd
    saves what the fused kernel keeps (q, k, v, output, log-sum-exp); a mask is treated as
    causal when `causal`, else as padding (its memory is the producer's)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
             "enable_gqa")
    bound = dict(zip(names, args)) | dict(kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    if bound.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    out = _aten._scaled_dot_product_flash_attention(
        q, k, v, float(bound.get("dropout_p", 0.0) or 0.0),
        bool(bound.get("is_causal", False)) or causal, False, scale=bound.get("scale"))
    return out[0]


def is_causal_mask(node: fx.Node, *, depth: int = 40) -> bool:
    """Whether attention node `node` is causal: `is_causal=True`, or a mask built by comparing
    two position ranges (`arange` <= `arange`, as transformers' causal masks are)."""
    if node.kwargs.get("is_causal") or (len(node.args) > 5 and node.args[5] is True):
        return True
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    if not isinstance(mask, fx.Node):
        return False
    seen: set[fx.Node] = set()
    frontier = [mask]
    for _ in range(depth):
        step = []
        for n in frontier:
            if n.target in _COMPARISONS and all(
                    isinstance(a, fx.Node) and _from_arange(a, depth) for a in n.args[:2]):
                return True
            step += [a for a in n.all_input_nodes if a not in seen]
            seen.update(n.all_input_nodes)
        frontier = step
    return False


def _from_arange(node: fx.Node, depth: int) -> bool:
    frontier, seen = [node], {node}
    for _ in range(depth):
        step = []
        for n in frontier:
            if n.target is _aten.arange.default or n.target is _aten.arange.start:
                return True
            step += [a for a in n.all_input_nodes if a not in seen]
            seen.update(n.all_input_nodes)
        frontier = step
    return False
