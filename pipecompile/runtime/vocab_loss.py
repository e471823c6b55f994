"""Vocabulary-parallel cross entropy at run time: the loss of logits split along their
vocabulary over T ranks, without gathering them (Megatron-LM's vocab_parallel_cross_entropy).

    cross_entropy_over(group, degree, rank)  -> ce(local, target, reduction, ignore_index)
    output_over(gather)                      -> out(local, dim): gathered, or local while
                                                `local_outputs()` is entered
    VocabLoss(split, gather, lower, degree)  the last stage's loss of its local logits

Forward, per token: the max of the local logits, all-reduced (MAX); the target's logit where
this rank holds the target, else 0, all-reduced (SUM); the sum of exp(logit - max),
all-reduced (SUM); loss = log(sum) - (target's logit - max); tokens at `ignore_index` 0.
Backward: softmax (this rank's slice) minus the one-hot of the targets in its range, times the
incoming gradient; no communication. The loss is identical on every rank.

Class weights w (`weight=`, whole on every rank) scale a token's loss by w[target], a local
lookup, and "mean" divides by the sum of w[target] over the tokens not ignored. Label
smoothing eps (Megatron-LM's form, as torch defines it with weights too): loss =
(1 - eps) w[t] nll + eps / V * (-sum_j w_j log p_j), where sum_j w_j log p_j =
sum_j w_j (logit_j - max) - (sum_j w_j) log(sum of exponentials): the local sums of the
(weighted) logits join the target's logit and the sum of exponentials in their all-reduce
(no further collective). Backward: (1 - eps) w[t] (p - onehot) + eps / V (W p - w), W the
weights' sum (V without weights).

In a training forward of the last stage (`local_outputs()`, entered by runtime/forwards.py)
a split logits output stays this rank's slice; `VocabLoss` then traces the user's `loss_fn`
once per shape (torch's make_fx, pre-dispatch, on fake tensors of the whole logits): if it
reads the split outputs only through a cross entropy, the traced loss lowered by the pass
handed in (passes/vocab_loss.py `lower_loss`) runs on the slices; if it does not read them,
`loss_fn` runs as it is; otherwise they are gathered first (never wrong).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

__all__ = ["cross_entropy_over", "output_over", "local_outputs", "VocabLoss"]

_STATE = threading.local()


@contextlib.contextmanager
def local_outputs() -> Iterator[None]:
    """Split logits outputs stay this rank's slice while entered (this thread)."""
    before = getattr(_STATE, "local", False)
    _STATE.local = True
    try:
        yield
    finally:
        _STATE.local = before


def output_over(gather: Callable[[torch.Tensor, int], torch.Tensor]
                ) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """A split logits output as the graph returns it: `gather(x, dim)`, or `x` itself inside
    `local_outputs()`."""

    def vocab_output(x: torch.Tensor, dim: int) -> torch.Tensor:
        return x if getattr(_STATE, "local", False) else gather(x, dim)

    return vocab_output


AllReduce = Callable[[torch.Tensor, Any], None]  # in place, over the T ranks: (tensor, op)


def cross_entropy_over(group: Any, degree: int, rank: int, *,
                       all_reduce: AllReduce | None = None) -> Callable[..., torch.Tensor]:
    """Rank `rank`'s cross entropy of (N, V/T) local logits, the vocabulary split in T
    consecutive ranges (module docstring); `reduction` as aten's: 0 none, 1 mean (over the
    tokens not at `ignore_index`; with `weight`, over their classes' weights), 2 sum;
    `weight` the whole (V,) class weights, `label_smoothing` as `F.cross_entropy`'s.
    `all_reduce(tensor, op)` defaults to torch.distributed's over `group`."""
    def over_group(tensor: torch.Tensor, op: Any) -> None:
        dist.all_reduce(tensor, op=op, group=group)

    reduce: AllReduce = all_reduce if all_reduce is not None else over_group

    class _CrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, local: torch.Tensor, target: torch.Tensor, ignored: torch.Tensor,
                    weight: torch.Tensor | None, w_target: torch.Tensor | None,
                    smoothing: float) -> torch.Tensor:
            width = local.shape[-1]
            start = rank * width
            top = local.detach().amax(dim=-1)
            reduce(top, dist.ReduceOp.MAX)
            shifted = local.detach() - top.unsqueeze(-1)
            outside = (target < start) | (target >= start + width) | ignored
            mine = (target - start).masked_fill(outside, 0)
            picked = shifted.gather(-1, mine.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)
            exp = shifted.exp()
            parts = [picked, exp.sum(dim=-1)]
            w_local = None if weight is None else weight[start:start + width].to(local.dtype)
            if smoothing:  # the sum over the vocabulary of (weighted) logits, in the same call
                parts.append((shifted if w_local is None else shifted * w_local).sum(dim=-1))
            both = torch.stack(parts)
            reduce(both, dist.ReduceOp.SUM)
            picked, total = both[0], both[1]
            log_total = total.log()
            nll = log_total - picked
            if w_target is not None:
                nll = nll * w_target.to(local.dtype)
            loss = nll
            if smoothing:
                mass = width * degree if weight is None else weight.sum().to(local.dtype)
                smooth = mass * log_total - both[2]  # -sum_j w_j log p_j
                loss = (1 - smoothing) * nll + smoothing / (width * degree) * smooth
            loss = loss.masked_fill(ignored, 0)
            ctx.save_for_backward(exp, total, mine, outside, ignored, w_target, weight, w_local)
            ctx.smoothing, ctx.classes = smoothing, width * degree
            return loss

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            exp, total, mine, outside, ignored, w_target, weight, w_local = ctx.saved_tensors
            eps, classes = ctx.smoothing, ctx.classes
            soft = exp / total.unsqueeze(-1)
            scale = grad.masked_fill(ignored, 0)
            # d/dz of w_t nll: w_t (p - onehot)
            scale_nll = scale if w_target is None else scale * w_target.to(soft.dtype)
            # (1 - eps) w_t (p - onehot) + eps / V (W p - w): W the weights' sum (V unweighted)
            rows = torch.arange(soft.shape[0], device=soft.device)
            if not eps:
                soft[rows, mine] -= (~outside).to(soft.dtype)
                return soft * scale_nll.unsqueeze(-1), None, None, None, None, None
            mass = classes if weight is None else weight.sum().to(soft.dtype)
            coeff = (1 - eps) * scale_nll + eps / classes * mass * scale
            out = soft * coeff.unsqueeze(-1)
            out[rows, mine] -= ((1 - eps) * scale_nll).masked_fill(outside, 0)
            uniform = (eps / classes) * scale.unsqueeze(-1)
            out -= uniform if w_local is None else uniform * w_local
            return out, None, None, None, None, None

    def cross_entropy(local: torch.Tensor, target: torch.Tensor, reduction: int = 1,
                      ignore_index: int = -100, weight: torch.Tensor | None = None,
                      label_smoothing: float = 0.0) -> torch.Tensor:
        ignored = target == ignore_index
        # w[target] per token, 0 where ignored: a lookup of the whole weights, no communication
        w_target = (None if weight is None
                    else weight[target.masked_fill(ignored, 0)].masked_fill(ignored, 0))
        losses = _CrossEntropy.apply(local, target, ignored, weight, w_target,
                                     float(label_smoothing))
        if reduction == 0:
            return losses
        if reduction == 2:
            return losses.sum()
        count = (~ignored).sum() if w_target is None else w_target.sum()
        return losses.sum() / count.to(losses.dtype)

    return cross_entropy


Lower = Callable[[torch.fx.GraphModule, Mapping[int, int]], "torch.fx.GraphModule | None"]


class VocabLoss:
    """The last stage's loss when its flat outputs `split` (index -> vocabulary dim) are this
    rank's slices (module docstring): `gather(x, dim)` the all-gather, `lower(traced, split)`
    the traced loss on the slices or None."""

    def __init__(self, split: Mapping[int, int], gather: Callable[[torch.Tensor, int],
                                                                    torch.Tensor],
                 lower: Lower, degree: int):
        self.split, self.gather, self.lower, self.degree = dict(split), gather, lower, degree
        self._forms: dict[Any, tuple[str, Any]] = {}  # per shapes: how the loss runs

    @property
    def forms(self) -> tuple[str, ...]:
        """How the loss has read the split outputs, once each: "lowered", "unread",
        "gathered"."""
        return tuple(sorted({kind for kind, _ in self._forms.values()}))

    def form(self, outputs: tuple, target: Any, loss_fn: Callable[..., torch.Tensor],
             unflatten: Callable[[list], Any]) -> str:
        """"lowered", "unread" or "gathered": how `loss_fn` runs on these outputs."""
        return self._form(outputs, target, loss_fn, unflatten)[0]

    def __call__(self, outputs: tuple, target: Any, loss_fn: Callable[..., torch.Tensor],
                 unflatten: Callable[[list], Any]) -> torch.Tensor:
        """`loss_fn(unflatten(whole outputs), target)`, the split outputs local."""
        kind, lowered = self._form(outputs, target, loss_fn, unflatten)
        if kind == "lowered":
            return lowered(*outputs, *torch.utils._pytree.tree_leaves(target))
        if kind == "gathered":
            outputs = self.whole(outputs)
        return loss_fn(unflatten(list(outputs)), target)

    def whole(self, outputs: tuple) -> tuple:
        """`outputs` with the split ones gathered (backward: this rank's slice)."""
        return tuple(self.gather(o, self.split[i]) if i in self.split else o
                     for i, o in enumerate(outputs))

    def _form(self, outputs: tuple, target: Any, loss_fn: Callable[..., torch.Tensor],
              unflatten: Callable[[list], Any]) -> tuple[str, Any]:
        key = (tuple((tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None
                     for o in outputs), _shapes(target), id(loss_fn))
        if key not in self._forms:
            self._forms[key] = self._trace(outputs, target, loss_fn, unflatten)
        return self._forms[key]

    def _trace(self, outputs: tuple, target: Any, loss_fn: Callable[..., torch.Tensor],
               unflatten: Callable[[list], Any]) -> tuple[str, Any]:
        from torch.fx.experimental.proxy_tensor import make_fx

        def whole(i: int, o: Any) -> Any:
            if i not in self.split:
                return o
            shape = list(o.shape)
            shape[self.split[i]] *= self.degree
            return torch.empty(shape, dtype=o.dtype, device=o.device)

        def loss(*flat: Any) -> torch.Tensor:
            *outs, tgt = flat
            return loss_fn(unflatten(list(outs)), tgt)

        try:
            with torch.no_grad():
                examples = [whole(i, o) for i, o in enumerate(outputs)]
            traced = make_fx(loss, tracing_mode="fake", pre_dispatch=True,
                             _allow_non_fake_inputs=True)(*examples, target)
        except Exception:  # noqa: BLE001 - a loss make_fx cannot trace: gathered, as before
            return "gathered", None
        placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
        if len(placeholders) < len(outputs):
            return "gathered", None
        if not any(placeholders[i].users for i in self.split):
            return "unread", None
        lowered = self.lower(traced, self.split)
        return ("lowered", lowered) if lowered is not None else ("gathered", None)


def _shapes(value: Any) -> Any:
    leaves, spec = torch.utils._pytree.tree_flatten(value)
    return (str(spec), tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
                             for v in leaves))
