"""The last stage's loss: its flat outputs turned into the model's outputs, then the loss.

    LossSpec(unflatten, loss_fn, scale)    what compile was given (a step may rescale it)
    StageLoss(spec)(outputs, target)       the loss of one micro-batch's flat outputs
    StageLoss(spec).seed(loss)             the gradient backward starts from: the scale

Other stages hold a `StageLoss(None)`: `computes` is False and they backpropagate from their
outputs' gradients instead.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import LossError

__all__ = ["LossSpec", "StageLoss"]

_ALONE = object()  # a probe of the output structure: is unflatten([x]) just x?


@dataclass(frozen=True)
class LossSpec:
    """How the last stage turns flat model outputs into a loss."""

    unflatten: Callable[[list], Any]  # flat outputs -> the model's output structure
    loss_fn: Callable[..., torch.Tensor] | None
    scale: float  # each micro-batch loss is multiplied by this before backward (1/m: the mean)
    num_items: Any = None  # a step's num_items_in_batch: loss_fn gets it, losses are summed


class StageLoss:
    """The loss of a stage's outputs (`spec` None: the stage computes none). The spec may be
    replaced between steps (a loss scale, num_items); the output structure may not."""

    def __init__(self, spec: LossSpec | None, vocab: Any = None):
        self.spec = spec
        # tensor parallelism: the last stage's split logits, its loss read of them
        # (runtime/vocab_loss.py `VocabLoss`); None: no output is split
        self.vocab = vocab
        self._unflatten: Any = None
        self._scale: tuple[Any, Any] = (None, None)

    @property
    def computes(self) -> bool:
        """Whether this is the last stage, which turns its outputs into the loss."""
        return self.spec is not None

    def producing(self) -> Any:
        """The context a training forward of this stage runs in: with split logits, they stay
        this rank's slices (`__call__` with `local=True` reads them)."""
        if self.vocab is None:
            return contextlib.nullcontext()
        from .vocab_loss import local_outputs

        return local_outputs()

    def __call__(self, outputs: tuple, target: Any, *, local: bool = False) -> torch.Tensor:
        """The loss of flat `outputs` against `target`; a non-scalar result is a `LossError`.
        `local`: the outputs came from a forward run in `producing()`."""
        spec = self.spec
        assert spec is not None, "only the last stage computes the loss"
        if self._unflatten is None:  # one output that is the whole result: no pytree walk
            single = len(outputs) == 1 and spec.unflatten([_ALONE]) is _ALONE
            self._unflatten = (lambda flat: flat[0]) if single else spec.unflatten
        vocab = self.vocab if local and spec.loss_fn is not None else None
        if vocab is not None and spec.num_items is None:  # the loss reads the split logits
            loss = vocab(outputs, target, spec.loss_fn, self._unflatten)
        else:
            if vocab is not None:  # a loss given num_items reads them gathered
                outputs = vocab.whole(outputs)
            result = self._unflatten(list(outputs))
            if spec.loss_fn is None:
                loss = result
            elif spec.num_items is not None:
                loss = spec.loss_fn(result, target, num_items_in_batch=spec.num_items)
            else:
                loss = spec.loss_fn(result, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = (type(loss).__name__ if not isinstance(loss, torch.Tensor)
                    else f"a tensor of shape {tuple(loss.shape)}")
            source = "loss_fn" if spec.loss_fn is not None else "the model (no loss_fn given)"
            raise LossError(
                f"{source} returned {what}, not a scalar tensor; return a 0-dim loss "
                f"(e.g. reduce with .mean()) or pass loss_fn=... to compile()"
            )
        return loss

    def seed(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss's incoming gradient, the loss scale, made once per scale, dtype and device
        (autograd reads it and never writes it; held here, it is never stolen into a .grad).
        d(scale * loss) = scale * d(loss): the same gradients as scaling the loss, no extra op."""
        assert self.spec is not None, "only the last stage computes the loss"
        key = (self.spec.scale, loss.dtype, loss.device)
        if self._scale[0] != key:
            self._scale = (key, torch.full((), self.spec.scale, dtype=loss.dtype,
                                           device=loss.device))
        return self._scale[1]
