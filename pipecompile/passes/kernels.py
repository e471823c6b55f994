"""Each op of a block priced as a GPU runs it: the kernel model of absent devices.

The annotate pass runs a block's ops on fake tensors; for hardware described by its figures it
records, per op, what the device would do (`Recorder`), and prices the block (`Kernels.times`):

    matmul      an op with FLOPs (linear, mm, bmm, conv), recorded as a GEMM (m, n, k, batch)
    attention   scaled_dot_product_attention as one fused kernel (FlashAttention: run here as
                aten._scaled_dot_product_flash_attention, so autograd saves q, k, v, the output
                and the log-sum-exp, O(s), never the s x s scores), recorded with its batch x
                heads, sequences, head dimension and whether its mask is causal
    memory      every other op that makes a new tensor (norms, softmax, elementwise, the loss):
                the bytes it reads and writes (dropout: and its one-byte mask per element);
                backward twice that, except where the kernels torch runs are known
                (`ruled`): a softmax, log-softmax or cross-entropy over rows too long for
                shared memory (passes/kernel_prices.py: three passes over each row forward,
                the gradient read twice backward, NLL's zero-filled gradient), a dtype
                cast (backward: one cast of the gradient back, the same bytes) and an
                embedding (the rows it gathers; backward zero-fills the table's gradient)
    view        an op whose output shares an input's storage (view, transpose, expand): free

On a preset (`HardwareRates.chip`) each kernel is priced by its shape (passes/kernel_prices.py:
tile and wave quantisation of GEMMs, FlashAttention-2 by sequence, memory-bound kernels by
bytes, at least a launch each), backward as each GEMM's two backward GEMMs, FlashAttention's
backward and twice the memory-bound traffic, and `Kernels.parts` says how much of each kind.
Without a chip (a spec of one's own), the rates price the sums: matmul rooflines at the spec's
rate, attention FLOPs (half for a causal mask) at the attention rate, bytes at memory
bandwidth, a launch cost per kernel, and backward as the counted backward FLOPs at the block's
forward matmul rate (FlashAttention's backward, 2.5x its forward FLOPs, at the attention
rate) with twice the forward's memory traffic and launches. All quantities are sympy
expressions of the captured sizes, evaluated per micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from .kernel_prices import (SHARED_MEMORY_PER_BLOCK, Chip, attention_seconds,
                            cross_entropy_bytes, embedding_bytes, matmul_seconds,
                            softmax_bytes)

__all__ = ["ATTENTION_OPS", "Kernels", "KernelTimes", "Recorder", "fused_attention",
           "is_causal_mask", "HardwareRates"]

_aten = torch.ops.aten
#: The attention ops priced as one fused kernel.
ATTENTION_OPS = (_aten.scaled_dot_product_attention.default,)
_COMPARISONS = {_aten.le.Tensor, _aten.lt.Tensor, _aten.ge.Tensor, _aten.gt.Tensor}
_BATCHED = {_aten.bmm.default, _aten.baddbmm.default}
_MATMUL = {_aten.matmul.default}
#: Dropout as recorded: one op whose CUDA kernel also writes a one-byte mask per element
#: (aten native_dropout: the bool mask that backward reads), which the op's output omits.
_DROPOUT = _aten.dropout.default
#: Softmax-like ops over the last dimension: (is log-softmax) by op.
_SOFTMAX = {_aten._softmax.default: False, _aten.softmax.int: False,
            _aten._log_softmax.default: True, _aten.log_softmax.int: True}
_CROSS_ENTROPY = _aten.cross_entropy_loss.default
_EMBEDDING = _aten.embedding.default
#: A dtype cast: its backward casts the gradient back (the same bytes, one kernel).
_CASTS = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default}
#: FlashAttention's backward runs 2.5x its forward FLOPs (recomputes QK^T; dQ, dK, dV, dP).
FLASH_BACKWARD = 2.5


@dataclass(frozen=True)
class HardwareRates:
    """What the kernel model needs of a device: sustained FLOP/s of large matmuls and of fused
    attention, memory bytes/s, seconds per kernel launch; with `chip` (a preset's figures),
    every kernel is priced by its shape (`passes.kernel_prices`) in `dtype`."""

    matmul: float
    attention: float
    memory: float
    launch: float = 0.0
    chip: Chip | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class KernelTimes:
    """Seconds of a block's kernels by kind, forward or backward: matmuls, fused attention,
    memory-bound ops, what kernels too small to fill their launch add (`launch`), and the
    softmax / log-softmax / cross-entropy kernels over rows longer than shared memory holds
    (`loss`: the loss over a vocabulary, apart from the other memory-bound kernels)."""

    matmul: float = 0.0
    attention: float = 0.0
    memory: float = 0.0
    launch: float = 0.0
    loss: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.memory + self.launch + self.loss

    def __add__(self, other: "KernelTimes") -> "KernelTimes":
        return KernelTimes(self.matmul + other.matmul, self.attention + other.attention,
                           self.memory + other.memory, self.launch + other.launch,
                           self.loss + other.loss)

    def scaled(self, factor: float) -> "KernelTimes":
        return KernelTimes(self.matmul * factor, self.attention * factor,
                           self.memory * factor, self.launch * factor, self.loss * factor)

    def with_loss(self, seconds: float) -> "KernelTimes":
        """These times with `seconds` of the memory-bound kernels named the loss."""
        moved = min(max(0.0, seconds), self.memory)
        return replace(self, memory=self.memory - moved, loss=self.loss + moved)


#: A GEMM as recorded: (m, n, k, batch, bytes per element, how many), sympy expressions.
Gemm = tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr, int, int]
#: A fused attention: (batch x heads, queries, keys, head dimension, causal, how many).
Flash = tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr, bool, int]


@dataclass(frozen=True)
class Kernels:
    """A block's ops as kernels (sympy expressions of the sizes): matmuls as (FLOPs, bytes)
    pairs, attention FLOPs as run (causal: halved) and as counted, memory-bound bytes, and
    the number of kernels launched; and each kernel's shape (`gemms`, `flash`, `moves`: bytes
    of each memory-bound kernel with its count), which a `Chip` prices. `split`: those of the
    memory-bound kernels whose output has four or more dimensions (a tensor split in heads
    when the block runs attention), as (bytes, the output's rows: its elements over its last
    dimension, how many); tensor parallelism prices them (planner/tensor_costs.py). `ruled`:
    those of the memory-bound kernels whose backward is not twice the forward's traffic, as
    (forward bytes, backward bytes, how many): a priced backward is corrected by the
    difference (planner/tensor_costs.py splits them as it splits their `moves`). `loss`: the
    forward bytes of those ruled kernels that are a softmax, log-softmax or cross-entropy over
    rows too long for shared memory (the loss over a vocabulary), which `parts` names apart."""

    matmuls: tuple[tuple[sympy.Expr, sympy.Expr], ...] = ()
    attention: sympy.Expr = sympy.Integer(0)  # FLOPs the fused kernels run (forward)
    attention_counted: sympy.Expr = sympy.Integer(0)  # FLOPs the counter saw (forward)
    memory: sympy.Expr = sympy.Integer(0)  # bytes read + written by memory-bound ops
    launches: int = 0
    gemms: tuple[Gemm, ...] = ()
    flash: tuple[Flash, ...] = ()
    moves: tuple[tuple[sympy.Expr, int], ...] = ()
    split: tuple[tuple[sympy.Expr, sympy.Expr, int], ...] = ()
    ruled: tuple[tuple[sympy.Expr, sympy.Expr, int], ...] = ()
    loss: tuple[sympy.Expr, ...] = ()

    def times(self, backward_flops: float, rates: HardwareRates,
              value: Callable[[sympy.Expr], float]) -> tuple[float, float]:
        """(forward, backward) seconds on a device of `rates`; `value` evaluates an expression
        at the micro-batch's sizes; `backward_flops` is the block's counted backward."""
        forward, backward = self.parts(backward_flops, rates, value)
        return forward.total, backward.total

    def parts(self, backward_flops: float, rates: HardwareRates,
              value: Callable[[sympy.Expr], float]) -> tuple[KernelTimes, KernelTimes]:
        """(forward, backward) seconds by kind (`KernelTimes`)."""
        if rates.chip is not None and (self.gemms or self.flash or self.moves
                                       or not self.launches):
            return self._shaped(backward_flops, rates.chip, rates.dtype, value)
        flops = bytes_ = compute = 0.0
        for f, b in self.matmuls:
            fv, bv = value(f), value(b)
            flops += fv
            bytes_ += bv
            compute += max(fv / rates.matmul, bv / rates.memory)
        rate = flops / compute if compute > 0 else rates.matmul  # the block's matmul rate
        attention = value(self.attention) / rates.attention
        memory = value(self.memory) / rates.memory
        ruled = sum(c * (value(b) - 2 * value(f)) for f, b, c in self.ruled) / rates.memory
        launch = self.launches * rates.launch
        counted = value(self.attention_counted)
        matmul_backward = max(0.0, backward_flops - FLASH_BACKWARD * counted)
        loss_f, loss_b = self._loss(rates.memory, value)
        return (KernelTimes(compute, attention, memory, launch).with_loss(loss_f),
                KernelTimes(matmul_backward / rate, FLASH_BACKWARD * attention,
                            2 * memory + ruled, 2 * launch).with_loss(loss_b))

    def _loss(self, bandwidth: float, value: Callable[[sympy.Expr], float]
              ) -> tuple[float, float]:
        """(forward, backward) seconds of the ruled kernels named the loss (`loss`) at
        `bandwidth` bytes/s: already in the memory-bound time, which `with_loss` moves."""
        named = set(self.loss)
        forward = sum(c * value(f) for f, _, c in self.ruled if f in named) / bandwidth
        backward = sum(c * value(b) for f, b, c in self.ruled if f in named) / bandwidth
        return forward, backward

    def _shaped(self, backward_flops: float, chip: Chip, dtype: str | None,
                value: Callable[[sympy.Expr], float]) -> tuple[KernelTimes, KernelTimes]:
        """Each kernel by its shape on `chip` (passes.kernel_prices); the part of a kernel's
        time that only its launch floor adds is `launch`."""
        fwd, bwd = _Split(chip), _Split(chip)
        gemm_flops = 0.0
        for m, n, k, batch, size, count in self.gemms:
            mv, nv, kv, bv = value(m), value(n), value(k), value(batch)
            gemm_flops += 2 * mv * nv * kv * bv * count
            fwd.matmul(count, mv, nv, kv, bv, dtype, size)
            # dX = dY W^T (m x k, inner n) and dW = X^T dY (k x n, inner m)
            bwd.matmul(count, mv, kv, nv, bv, dtype, size)
            bwd.matmul(count, kv, nv, mv, bv, dtype, size)
        counted = value(self.attention_counted)
        matmul_backward = max(0.0, backward_flops - FLASH_BACKWARD * counted)
        # what autograd runs of the matmuls' two backward GEMMs (none for frozen weights or
        # inputs that need no gradient)
        share = min(1.0, matmul_backward / (2 * gemm_flops)) if gemm_flops > 0 else 0.0
        bwd.times = bwd.times.scaled(share)
        for heads, s_q, s_k, d, causal, count in self.flash:
            shape = (value(heads), value(s_q), value(s_k), value(d))
            fwd.attention(count, *shape, causal, False, dtype)
            bwd.attention(count, *shape, causal, True, dtype)
        for nbytes, count in self.moves:
            seconds = value(nbytes) / chip.bandwidth
            fwd.memory(count, seconds)
            bwd.memory(2 * count, seconds)  # backward: twice the traffic and launches
        for forward, backward, count in self.ruled:  # the kernels' own backward instead
            extra = count * (value(backward) - 2 * value(forward)) / chip.bandwidth
            bwd.times = bwd.times + KernelTimes(memory=extra)
        loss_f, loss_b = self._loss(chip.bandwidth, value)
        return fwd.times.with_loss(loss_f), bwd.times.with_loss(loss_b)


class _Split:
    """Accumulates kernel seconds by kind on a chip, separating the launch floor."""

    def __init__(self, chip: Chip) -> None:
        self.chip, self.times = chip, KernelTimes()

    def _add(self, kind: str, count: float, work: float) -> None:
        floor = max(0.0, self.chip.launch - work)
        self.times = self.times + KernelTimes(
            **{kind: count * work}, launch=count * floor)

    def matmul(self, count: float, m: float, n: float, k: float, batch: float,
               dtype: str | None, size: int) -> None:
        if m * n * k * batch <= 0:
            return
        work = matmul_seconds(replace(self.chip, launch=0.0), m, n, k, batch=batch,
                              dtype=dtype, itemsize=size)
        self._add("matmul", count, work)

    def attention(self, count: float, heads: float, s_q: float, s_k: float, d: float,
                  causal: bool, backward: bool, dtype: str | None) -> None:
        work = attention_seconds(replace(self.chip, launch=0.0), heads, s_q, s_k, d,
                                 causal=causal, backward=backward, dtype=dtype)
        self._add("attention", count, work)

    def memory(self, count: float, seconds: float) -> None:
        self._add("memory", count, seconds)


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
    gemms: list[tuple] = field(default_factory=list)
    flash: list[tuple] = field(default_factory=list)
    moves: list[sympy.Expr] = field(default_factory=list)
    split: list[tuple[sympy.Expr, sympy.Expr]] = field(default_factory=list)
    ruled: list[tuple[sympy.Expr, sympy.Expr]] = field(default_factory=list)
    loss: list[sympy.Expr] = field(default_factory=list)

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
            q, k = inputs[0], inputs[1]
            if q.dim() >= 3:
                heads = sympy.expand(self.sym(q.numel()) / (self.sym(q.shape[-2])
                                                            * self.sym(q.shape[-1])))
                self.flash.append((heads, self.sym(q.shape[-2]), self.sym(k.shape[-2]),
                                   self.sym(q.shape[-1]), bool(causal)))
            return
        storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
        if all(StorageWeakRef(t.untyped_storage()) in storages for t in outputs):
            return  # a view: no kernel
        moved = sum((self._bytes(t) for t in [*inputs, *outputs]), sympy.Integer(0))
        if node.target is _DROPOUT and _training(args, kwargs):
            moved += self.sym(outputs[0].numel())  # the mask: one byte per element
        rule = self._rule(node, args, inputs, outputs[0])
        if rule is not None:
            moved = rule[0]
            self.ruled.append((sympy.expand(rule[0]), sympy.expand(rule[1])))
            if node.target in _SOFTMAX or node.target is _CROSS_ENTROPY:
                self.loss.append(sympy.expand(rule[0]))  # a row too long: the loss
        flops = self.sym(flops)
        if flops != 0:
            self.matmuls.append((flops, moved))
            self.gemms.append(self._gemm(node, inputs, outputs[0], flops))
        else:
            self.memory += moved
            self.moves.append(sympy.expand(moved))
            if outputs[0].dim() >= 4:  # heads apart (Kernels.split)
                rows = self.sym(outputs[0].numel()) / self.sym(outputs[0].shape[-1])
                self.split.append((sympy.expand(moved), sympy.expand(rows)))
        self.launches += 1

    def _rule(self, node: fx.Node, args: Any, inputs: list[torch.Tensor], out: torch.Tensor
              ) -> tuple[sympy.Expr, sympy.Expr] | None:
        """(forward, backward) bytes of an op whose kernels are known (`Kernels.ruled`), else
        None: softmax-like ops over the last dimension of rows shared memory cannot hold,
        cross-entropy over 2-D logits with class indices, dtype casts, embeddings."""
        x = inputs[0] if inputs else None
        if x is None or x.dim() == 0 or not x.is_floating_point():
            return None
        if (node.target is _EMBEDDING and x.dim() == 2 and len(inputs) > 1
                and not inputs[1].is_floating_point()):
            n, size = self.sym(inputs[1].numel()), x.element_size()
            width, table = self.sym(x.shape[1]), self.sym(x.shape[0])
            return (embedding_bytes(n, width, table, size),
                    embedding_bytes(n, width, table, size, backward=True))
        if node.target in _CASTS and out.dtype != x.dtype:
            moved = self._bytes(x) + self._bytes(out)
            return moved, moved
        row = self.sym(x.shape[-1])
        rows = self.sym(x.numel()) / row
        size = x.element_size()
        # a row's length is a model size (the vocabulary), never the symbolic batch
        long = isinstance(x.shape[-1], int) and x.shape[-1] >= _cached_row(size)
        if (node.target in _SOFTMAX and long and len(args) > 1
                and isinstance(args[1], int) and args[1] in (-1, x.dim() - 1)):
            log = _SOFTMAX[node.target]
            return (softmax_bytes(rows, row, size, out.element_size(), log=log),
                    softmax_bytes(rows, row, size, out.element_size(), log=log,
                                  backward=True))
        smoothing = float(args[5]) if len(args) > 5 else 0.0
        if (node.target is _CROSS_ENTROPY and x.dim() == 2 and len(inputs) > 1
                and not inputs[1].is_floating_point() and not smoothing and long):
            return (cross_entropy_bytes(rows, row, size),
                    cross_entropy_bytes(rows, row, size, backward=True))
        return None

    def _gemm(self, node: fx.Node, inputs: list[torch.Tensor], out: torch.Tensor,
              flops: sympy.Expr) -> tuple:
        """(m, n, k, batch, bytes per element) of a matmul-like op from its output and FLOPs:
        n the output's last dimension, k = FLOPs / (2 x output elements); batched (bmm,
        matmul of two 3-D+ operands) over the leading dimensions, else m = every output row."""
        numel = self.sym(out.numel())
        n = self.sym(out.shape[-1]) if out.dim() else sympy.Integer(1)
        k = sympy.simplify(flops / (2 * numel))
        batched = node.target in _BATCHED or (
            node.target in _MATMUL and len(inputs) >= 2 and min(inputs[0].dim(),
                                                                inputs[1].dim()) >= 3)
        if batched and out.dim() >= 3:
            m = self.sym(out.shape[-2])
            batch = sympy.expand(numel / (m * n))
        else:
            m, batch = sympy.expand(numel / n), sympy.Integer(1)
        return (m, n, k, batch, out.element_size())

    def _bytes(self, t: torch.Tensor) -> sympy.Expr:
        return self.sym(t.numel()) * t.element_size()

    def kernels(self) -> Kernels:
        """The block's kernels, repeated shapes merged (a layer's q, k, v projections)."""
        merged: dict[tuple[sympy.Expr, sympy.Expr], int] = {}
        for pair in self.matmuls:
            merged[pair] = merged.get(pair, 0) + 1
        return Kernels(tuple((f * n, b * n) for (f, b), n in merged.items()),
                       sympy.expand(self.attention), sympy.expand(self.attention_counted),
                       sympy.expand(self.memory), self.launches,
                       gemms=tuple((*g, n) for g, n in _counts(self.gemms).items()),
                       flash=tuple((*a, n) for a, n in _counts(self.flash).items()),
                       moves=tuple(_counts(self.moves).items()),
                       split=tuple((*a, n) for a, n in _counts(self.split).items()),
                       ruled=tuple((*a, n) for a, n in _counts(self.ruled).items()),
                       loss=tuple(_counts(self.loss)))


def _cached_row(itemsize: int) -> int:
    """The shortest row (elements) torch's softmax reads from HBM once per pass: longer than
    shared memory holds (kernel_prices.softmax_bytes)."""
    return int((SHARED_MEMORY_PER_BLOCK - 128) / itemsize)


def _training(args: Any, kwargs: Any) -> bool:
    """Whether aten.dropout(input, p, train) drops anything (train and p > 0)."""
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.0)
    train = kwargs.get("train", args[2] if len(args) > 2 else False)
    return bool(train) and float(p) > 0


def _counts(items: list) -> dict:
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


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
