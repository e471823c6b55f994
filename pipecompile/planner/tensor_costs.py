"""Each rank's share of a block's costs under tensor parallelism (T ranks shard each layer).

    shard_costs(costs, share, shapes=, rates=, batch_size=) -> the CostTable one rank of T runs
    attention_heads(costs, batch_size)               -> the query heads of each attention
    vocabulary_price(layer, share, flops=, optimizer_factor=) -> split a vocabulary or not
    vocabulary_choices(gm, share, ...)               -> that choice for each table of a graph

**The vocabulary** (embeddings and the output layer, passes/tensor_shard.py splits them or not
as this prices them): over the n tokens the graph records, forward and backward, replicated
costs the output layer's whole GEMM (6 n V h FLOPs) and no collective; split costs 1/T of it
plus the all-reduce of its input's gradient (n h) and the collectives over its logits as
they run (the layer's `loss`, passes/tensor_shard.py from how the logits are read and
planner/logits_loss.py from the pipeline's `loss_fn`): "parallel" (only a cross entropy reads
them, vocabulary-parallel: its two all-reduces of n and 2 n elements, no gather) or
"gathered" (their all-gather, n V elements), and for an embedding the all-reduce of the
looked-up rows (n h). Split frees (1 - 1/T) of the
table's weight, gradient and optimizer state on each rank. A table is split when that is no
slower, or when it frees at least `MEMORY_WORTH` of the device's memory (Llama-3-70B's
128256 x 8192 table in bf16 is 2 GiB, 8 GiB more of AdamW state): memory the plan spends on
micro-batches, fewer stages or less recomputation. A small table stays whole. `vocabulary=`
True or False (compile's `vocab_parallel`) overrides the price. In `shard_costs` a table
priced whole keeps its bytes and its GEMM whole on every rank; one priced split runs its
GEMM 1/T, and with "parallel" logits the loss over the vocabulary 1/T plus the cross
entropy's all-reduces in forward (as Megatron-LM runs it, and the published runs held against
bench/ ran), with "gathered" ones the all-gather in forward and the loss whole on every rank
(as pipecompile's runtime then runs it). The choice above leaves the loss's own time out
(alike whole and gathered; 1/T of it is saved with "parallel", not counted there).

What is sharded is estimated from the captured blocks by one rule, the rule a Megatron-style
sharding pass follows (the runtime's pass decides per op when it runs; this prices the same
choice ahead of time):

- a **weight matmul** (a GEMM recorded with no batch dimension: linear, mm, addmm) whose
  output width n or inner size k divides by T runs 1/T of its FLOPs on each rank: priced as
  the GEMM (m, n/T, k) (column-parallel) where T divides n and n >= k, else (m, n, k/T)
  (row-parallel); the output layer's GEMM over the vocabulary is one of them when its
  table is priced split (above), else whole. A batched GEMM whose batch (batch x heads) divides by T is attention written
  out as matmuls (QK^T, then by V: two per attention) and runs batch / T on each rank;
- **fused attention** runs heads / T of its heads on each rank;
- **memory-bound kernels** (norms, residual adds, softmax, elementwise, the loss) run whole on
  every rank, replicated, except those over the MLP's intermediate or the vocabulary (bytes
  per token a whole multiple of the widest side of the block's sharded GEMMs, when that side
  is wider than the narrowest: the MLP's activation and product, the vocabulary-parallel
  loss), which run 1/T, and except those on the attention's heads, which run 1/T too: in a
  block with attention (fused, or batched GEMMs), a kernel whose output has four or more
  dimensions and a whole number of heads per token divisible by T (its elements over its
  last dimension, per row of the weight matmuls: queries, keys and values as (b, heads, s,
  d) or (s, b, heads, d), their rotary embeddings, the s x s scores of an attention written
  out, its output before the heads merge). With sequence parallelism every memory-bound
  kernel runs on 1/T of the tokens;
- **parameters, gradients and optimizer state**: every parameter with two or more dimensions
  one of whose first two divides by T is held 1/T per rank (Megatron shards every weight
  matrix and the vocabulary of the embedding); vectors (norm weights, biases) are replicated;
- **activations kept for backward**: a block with a sharded weight matmul keeps
  10/34 + 24/(34 T) of them per rank (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models", arXiv 2205.05198, section 4: a transformer
  layer keeps s b h (34 + 5 a s / h) bytes at 16 bits, s b h (10 + 24 / t + 5 a s / (h t))
  under tensor parallelism; with fused attention the a s / h term is gone), all of them / T
  with sequence parallelism (34 / t); other blocks keep theirs whole;
- **collectives**, on the critical path (not overlapped with compute: Megatron-LM's
  all-reduces wait for the matmul that feeds them): each column/row pair ends in one
  all-reduce of the pair's output in forward and one of its input gradient in backward
  (Narayanan et al. SC'21, section 2.3: 2 all-reduces per transformer layer in forward and 2
  in backward). A block runs one pair per attention (fused, or two batched GEMMs; bytes: the
  attention's query, b s h, or b s times the narrowest sharded side) plus one for its MLP
  when it also has a weight matmul wider than the attention; a
  block without attention that holds a sharded weight runs one pair of its output boundary's
  bytes (an MLP block; the vocabulary-parallel embedding). With sequence parallelism each
  all-reduce is a reduce-scatter and an all-gather of the same bytes: the same time on a ring
  (planner/collectives.py). Priced over the group's link (NVLink inside a node).

Pipeline messages stay whole (each rank of a group sends the full boundary to its counterpart
in the next stage, the T messages in parallel over their own links). The FLOP counts of the
blocks stay the model's (what MFU counts); their times, bytes and activations are one rank's.
Pure: a new table, the input unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import sympy

if TYPE_CHECKING:
    import torch

from ..ir.records import CostTable, evaluate
from ..ir.shard_plan import VocabularyLayer
from ..passes.annotate import PricedBlockCost
from ..passes.kernels import FLASH_BACKWARD, HardwareRates, Kernels
from .cluster import Link
from .collectives import Group, all_gather, all_reduce

__all__ = ["TensorShare", "shard_costs", "attention_heads", "REPLICATED_ACTIVATIONS",
           "VocabularyPrice", "vocabulary_price", "vocabulary_choices", "MEMORY_WORTH"]

#: Of a transformer layer's 34 s b h activation bytes, those tensor parallelism leaves whole
#: (the layer norms' inputs and the dropout masks; Korthikanti et al. 2022, section 4.2.2).
REPLICATED_ACTIVATIONS = 10 / 34


@dataclass(frozen=True)
class TensorShare:
    """T ranks sharding each layer, their group's link, and whether they run sequence
    parallelism (reduce-scatter + all-gather instead of all-reduce; norms on 1/T)."""

    degree: int
    link: Link
    sequence_parallel: bool = False
    memory: float = math.inf  # bytes of one device (the vocabulary's price: `MEMORY_WORTH`)

    def all_reduce(self, nbytes: float) -> float:
        """Seconds of one all-reduce of `nbytes` over the group (one node, a ring)."""
        return all_reduce(nbytes, Group(self.degree, 1), self.link, self.link)

    def all_gather(self, nbytes: float) -> float:
        """Seconds of one all-gather of `nbytes` (the gathered size) over the group."""
        return all_gather(nbytes, Group(self.degree, 1), self.link, self.link)


#: A vocabulary table is split, even where splitting is slower, when that frees at least this
#: share of a device's memory on each rank (module docstring).
MEMORY_WORTH = 0.01


@dataclass(frozen=True)
class VocabularyPrice:
    """What splitting one vocabulary table over T ranks costs and frees (module docstring):
    seconds of forward and backward over the layer's tokens whole and split, bytes freed per
    rank; `given`: compile's
    `vocab_parallel` when it was True or False."""

    layer: VocabularyLayer
    degree: int
    whole: float
    split: float
    freed: float
    memory: float
    given: bool | None = None

    @property
    def chosen(self) -> bool:
        """Whether the table is split."""
        if self.given is not None:
            return self.given
        return self.split <= self.whole or self.freed >= MEMORY_WORTH * self.memory

    def __str__(self) -> str:
        roles = " and ".join("output layer" if r == "output" else r for r in self.layer.roles)
        why = (f"vocab_parallel={self.given}" if self.given is not None else
               "no slower" if self.split <= self.whole else
               f"frees >= {MEMORY_WORTH:.0%} of the device's memory" if self.chosen else
               "cheaper whole")
        return (f"{self.layer.name} ({roles}, {self.layer.vocab} x {self.layer.hidden}) "
                f"{f'split over {self.degree}' if self.chosen else 'replicated'} ({why}): "
                f"{self.split * 1e3:.3g} ms split vs {self.whole * 1e3:.3g} ms whole over "
                f"{self.layer.tokens} tokens, {self.freed / 2**30:.3g} GiB freed per rank"
                + ("" if not self.chosen or "output" not in self.layer.roles else
                   "; its logits never gathered (cross entropy vocabulary-parallel)"
                   if self.layer.loss == "parallel" else "; its logits all-gathered"))


def vocabulary_price(layer: VocabularyLayer, share: TensorShare, *, flops: float,
                     optimizer_factor: float, given: bool | None = None) -> VocabularyPrice:
    """The price of splitting `layer` over `share`'s ranks (module docstring), matmuls at
    `flops` FLOP/s, `optimizer_factor` optimizer-state bytes per parameter byte."""
    t, n, v, h, size = share.degree, layer.tokens, layer.vocab, layer.hidden, layer.itemsize
    whole = split = 0.0
    if "output" in layer.roles:
        gemm = 6 * n * v * h / flops  # forward, the input's and the weight's gradients
        whole += gemm
        split += gemm / t + share.all_reduce(n * h * size) + _logits_collectives(
            share, n, v, size, layer.loss)
    if "embedding" in layer.roles:
        split += share.all_reduce(n * h * size)
    freed = v * h * size * (2 + optimizer_factor) * (1 - 1 / t)
    return VocabularyPrice(layer, t, whole, split, freed, share.memory, given)


def _logits_collectives(share: TensorShare, tokens: float, vocab: int, itemsize: int,
                        loss: str) -> float:
    """Seconds of the collectives over split logits in forward: their all-gather (n V
    elements; backward: a slice) when "gathered", else the vocabulary-parallel cross
    entropy's two all-reduces (the max, n elements; the target's logit and the sum of
    exponentials, 2 n; backward: none)."""
    if loss == "gathered":
        return share.all_gather(tokens * vocab * itemsize)
    return share.all_reduce(tokens * itemsize) + share.all_reduce(2 * tokens * itemsize)


def vocabulary_choices(gm: "torch.fx.GraphModule", share: TensorShare, *, flops: float,
                       optimizer_factor: float, given: bool | None = None,
                       loss_reads: Mapping[int, str] | None = None
                       ) -> dict[str, VocabularyPrice]:
    """Each vocabulary table of `gm` (passes/tensor_shard.py `vocabulary_layers`, the
    pipeline's loss reading `gm`'s outputs as `loss_reads` says) priced."""
    from ..passes.tensor_shard import vocabulary_layers

    return {layer.name: vocabulary_price(layer, share, flops=flops,
                                         optimizer_factor=optimizer_factor, given=given)
            for layer, *_ in vocabulary_layers(gm, share.degree, loss_reads=loss_reads)}


def _value(costs: CostTable) -> Callable[[sympy.Expr], float]:
    return lambda e: evaluate(e, costs.sizes)


def _sharded_param(shape: Sequence[int] | None, t: int) -> bool:
    return shape is not None and len(shape) >= 2 and any(d % t == 0 for d in shape[:2])


@dataclass(frozen=True)
class _Sharded:
    """What `_shard_kernels` found: one rank's kernels and backward FLOPs, and the block's
    shape as the sharded GEMMs show it."""

    kernels: Kernels
    backward_flops: float
    widest: int  # the widest side of a sharded weight matmul (0: none)
    narrowest: int  # its narrowest side (the model width h of a transformer layer)
    tokens: float  # rows of the weight matmuls (b s)
    itemsize: int
    unfused: int  # attentions written as two batched GEMMs each (QK^T, then by V)
    logits: tuple[tuple[float, int, int, str], ...] = ()  # split output layers: (rows,
    # vocabulary, bytes per element, "parallel" or "gathered")


def _shard_kernels(k: Kernels, t: int, value: Callable[[sympy.Expr], float],
                   backward_flops: float, sequence: bool,
                   whole: frozenset[tuple[int, int]] = frozenset(),
                   outputs: Mapping[tuple[int, int], str] | None = None) -> _Sharded:
    """One rank's share of a block's kernels (module docstring); a weight GEMM whose (n, k)
    is in `whole` (an output layer priced replicated) runs whole; one in `outputs` (an
    output layer priced split: how its logits are read) runs 1/T, and the loss over its
    logits 1/T only when "parallel" (gathered logits: the loss whole on every rank)."""
    gemms, full, mine, itemsize, batched = [], 0.0, 0.0, 2, 0
    tokens, sides = 0.0, []
    logits: list[tuple[float, int, int, str]] = []
    outputs = outputs or {}
    for m, n, kk, batch, size, count in k.gemms:
        mv, nv, kv, bv = (value(x) for x in (m, n, kk, batch))
        flops = 2 * mv * nv * kv * bv * count
        full += flops
        itemsize = size
        ni, ki = int(round(nv)), int(round(kv))
        if bv == 1 and (ni, ki) not in whole and (ni % t == 0 or ki % t == 0):  # weight GEMM
            if ni % t == 0 and (ni >= ki or ki % t):
                n = n / t
            else:
                kk = kk / t
            mine += flops / t
            tokens = max(tokens, mv)
            read = outputs.get((ni, ki))
            if read is not None:
                logits.append((mv * count, ni, size, read))
            sides += [ni, ki] if read != "gathered" else []
        elif bv > 1 and int(round(bv)) % t == 0:  # batch x heads: attention by heads
            batch = batch / t
            mine += flops / t
            batched += count
        else:
            mine += flops
        gemms.append((m, n, kk, batch, size, count))
    share = mine / full if full > 0 else 1.0
    counted = value(k.attention_counted)
    matmul_backward = max(0.0, backward_flops - FLASH_BACKWARD * counted)
    backward = matmul_backward * share + FLASH_BACKWARD * counted / t
    # a memory-bound kernel over the MLP's intermediate (or the vocabulary): its bytes per
    # token a multiple of the widest sharded side above the model width (the narrowest side)
    wide = max(sides) if sides and max(sides) > min(sides) else 0
    heads = _on_heads(k, t, value, tokens) if k.flash or batched else {}
    moves: list[tuple[sympy.Expr, int]] = []
    for b, c in k.moves:
        mine_c = c if sequence or _inner(value(b), tokens, wide) else min(c, heads.get(b, 0))
        moves += [(b / t, mine_c)] if mine_c else []
        moves += [(b, c - mine_c)] if c > mine_c else []
    memory = sum((b * c for b, c in moves), sympy.Integer(0))
    # a kernel with its own backward (a loss over the vocabulary): split as its move is
    ruled: list[tuple[sympy.Expr, sympy.Expr, int]] = []
    for f, bw, c in k.ruled:
        mine_c = c if sequence or _inner(value(f), tokens, wide) else min(c, heads.get(f, 0))
        ruled += [(f / t, bw / t, mine_c)] if mine_c else []
        ruled += [(f, bw, c - mine_c)] if c > mine_c else []
    sharded = Kernels(
        matmuls=tuple((f * share, b * share) for f, b in k.matmuls),
        attention=k.attention / t, attention_counted=k.attention_counted / t,
        memory=memory if k.moves else k.memory / (t if sequence else 1),
        launches=k.launches, gemms=tuple(gemms),
        flash=tuple((heads / t, s_q, s_k, d, causal, count)
                    for heads, s_q, s_k, d, causal, count in k.flash),
        moves=tuple(moves), ruled=tuple(ruled),
        loss=tuple(x for f in k.loss for x in (f / t, f)))  # the loss, split or whole
    return _Sharded(sharded, backward, max(sides, default=0), min(sides, default=0), tokens,
                    itemsize, batched // 2, tuple(logits))


def _on_heads(k: Kernels, t: int, value: Callable[[sympy.Expr], float], tokens: float
              ) -> dict[sympy.Expr, int]:
    """How many of a block's memory-bound kernels, by their bytes, run on its attention's
    heads: an output of four or more dimensions (`Kernels.split`) whose rows per token (its
    elements over its last dimension and the `tokens` of the weight matmuls) are a whole
    number of heads divisible by `t` (q, k, v and their rotary embeddings, the scores of an
    attention written out, its output before the heads merge)."""
    found: dict[sympy.Expr, int] = {}
    if tokens <= 0:
        return found
    for nbytes, rows, count in k.split:
        per_token = value(rows) / tokens
        whole = round(per_token)
        if whole >= t and abs(per_token - whole) < 1e-9 and whole % t == 0:
            found[nbytes] = found.get(nbytes, 0) + count
    return found


def _inner(nbytes: float, tokens: float, wide: int) -> bool:
    """Whether a memory-bound kernel of `nbytes` over `tokens` rows runs inside a sharded
    pair: its bytes per row a whole multiple of the MLP's (or vocabulary's) width `wide`."""
    if wide <= 0 or tokens <= 0:
        return False
    per_row = nbytes / tokens
    return per_row >= wide and abs(per_row / wide - round(per_row / wide)) < 1e-9


def shard_costs(costs: CostTable, share: TensorShare, *,
                shapes: Mapping[str, Sequence[int]], rates: HardwareRates | None,
                batch_size: int, vocabulary: Mapping[str, VocabularyPrice] | None = None
                ) -> CostTable:
    """The table of what one of `share.degree` ranks runs and holds per block (module
    docstring); `shapes`: each parameter's shape by the name the blocks use; `rates`: the
    kernel model of the device (None or a block not priced by kernels: its time stays whole,
    only its bytes shard); `batch_size`: the micro-batch size `costs` is evaluated at;
    `vocabulary`: the priced choice of each vocabulary table (`vocabulary_choices`)."""
    t = share.degree
    if t <= 1:
        return costs
    value = _value(costs)
    vocabulary = vocabulary or {}
    kept = {n for n, p in vocabulary.items() if not p.chosen}
    whole = frozenset((p.layer.vocab, p.layer.hidden) for p in vocabulary.values()
                      if not p.chosen and "output" in p.layer.roles)
    outputs = {(p.layer.vocab, p.layer.hidden): getattr(p.layer, "loss", "gathered")
               for p in vocabulary.values()
               if p.chosen and "output" in p.layer.roles}
    symbolic, blocks = [], []
    for i, (c, x) in enumerate(zip(costs.symbolic, costs.blocks)):
        sizes = [math.prod(shapes[n]) for n in c.parameters if n in shapes]
        held = sum(math.prod(shapes[n]) / t if _sharded_param(shapes[n], t) and n not in kept
                   else math.prod(shapes[n]) for n in c.parameters if n in shapes)
        keep = held / sum(sizes) if sum(sizes) > 0 else 1.0
        forward, backward, widest, pairs, nbytes, logits = 1.0, 1.0, 0, 0, 0.0, 0.0
        if isinstance(c, PricedBlockCost) and rates is not None:
            found = _shard_kernels(c.kernels, t, value, x.backward_flops,
                                   share.sequence_parallel, whole, outputs)
            widest = found.widest
            logits = sum(_logits_collectives(share, rows, v, size, read)
                         for rows, v, size, read in found.logits)
            f0, b0 = c.kernels.times(x.backward_flops, rates, value)
            f1, b1 = found.kernels.times(found.backward_flops, rates, value)
            forward = f1 / f0 if f0 > 0 else 1.0
            backward = b1 / b0 if b0 > 0 else 1.0
            # one pair per attention (its b s h bytes), one more for an MLP beside it
            attentions = sum(count for *_, count in c.kernels.flash) or found.unfused
            width: float = found.narrowest
            nbytes = found.tokens * found.narrowest * found.itemsize
            for heads, s_q, _, d, _, count in c.kernels.flash:
                width = value(heads) / max(1, batch_size) * value(d)  # h = heads x d
                nbytes = value(heads) * value(s_q) * value(d) * found.itemsize
            pairs = attentions * (2 if widest > width else 1)
            if not attentions and (widest or keep < 1):  # an MLP, an embedding, the logits
                pairs, nbytes = 1, costs.cut_bytes[i + 1]
        elif keep < 1:  # a block held sharded that is not priced by kernels
            pairs, nbytes = 1, costs.cut_bytes[i + 1]
        collective = pairs * share.all_reduce(nbytes)
        layer = widest > 0
        act = (1 / t if share.sequence_parallel else
               REPLICATED_ACTIVATIONS + (1 - REPLICATED_ACTIVATIONS) / t) if layer else 1.0
        symbolic.append(replace(c, param_bytes=int(round(c.param_bytes * keep)),
                                grad_bytes=int(round(c.grad_bytes * keep)),
                                optimizer_bytes=int(round(c.optimizer_bytes * keep)),
                                activation_bytes=c.activation_bytes * act))
        blocks.append(replace(x, forward_time=x.forward_time * forward + collective + logits,
                              backward_input_time=x.backward_input_time * backward + collective,
                              backward_weight_time=x.backward_weight_time * backward,
                              static_bytes=x.static_bytes * keep,
                              activation_bytes=x.activation_bytes * act))
    note = (f"tensor parallel {t}: each rank's share of the blocks, collectives over "
            f"{share.link.name}" + (", sequence parallel" if share.sequence_parallel else "")
            + "".join(f"; vocabulary: {p}" for p in vocabulary.values()))
    return replace(costs, symbolic=tuple(symbolic), blocks=tuple(blocks),
                   notes=(*costs.notes, note))


def attention_heads(costs: CostTable, batch_size: int) -> tuple[int, ...]:
    """The query heads of each fused attention the blocks run (batch x heads recorded, at
    micro-batch `batch_size`), once per distinct count; () when the capture shows none."""
    value = _value(costs)
    found = set()
    for c in costs.symbolic:
        if isinstance(c, PricedBlockCost):
            for heads, *_ in c.kernels.flash:
                found.add(int(round(value(heads) / max(1, batch_size))))
    return tuple(sorted(found))
