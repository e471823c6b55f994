"""A stage's backward behaviours, one chosen per stage when its worker is assembled.

    FusedBackward       B: one autograd backward, input and weight gradients together (a
                        schedule that still asks for I and W gets them split at the autograd
                        frontier, runtime/split_backward.py)
    SplitBackward       zero-bubble: the forward runs the graph with deferred linears, so I is
                        an ordinary backward giving the input gradients now and W the queued
                        weight matmuls later (runtime/weight_store.py); the autograd frontier
                        where nothing was deferred
    CompiledBackward    a compiled stage's backward is one autograd node with no frontier inside
                        it: I runs it whole, W only frees the micro-batch (runtime/compiled.py)
    VersionedBackward   PipeDream, 2BW: the gradient of the weight version the micro-batch's
                        forward used, kept for the next update (runtime/versions.py)

Each answers the forward's two questions too: which weights micro-batch i runs with
(`weights_for`), and which graph records what its backward needs (`graph_for`).

    full(i, saved, output grads)     B  -> input grads; frees micro-batch i
    inputs(i, saved, output grads)   I  -> input grads; keeps what W needs
    weights(i)                       W  accumulates the parameter gradients; frees it
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from . import split_backward
from .in_flight import InFlight, Saved
from .stage_call import StageCall
from .stage_loss import StageLoss
from .versions import WeightVersions
from .weight_store import WeightGradStore

__all__ = ["FusedBackward", "SplitBackward", "CompiledBackward", "VersionedBackward"]


class FusedBackward:
    """B as one autograd backward: parameter gradients accumulate into `.grad`; `sync` (FSDP's
    or DDP's hooks, `data_parallel.py`, else `NoSync`) is armed before it."""

    def __init__(self, call: StageCall, held: InFlight, loss: StageLoss, sync: Any):
        self.call, self.held, self.loss, self.sync = call, held, loss, sync

    def weights_for(self, mb: int) -> dict | None:
        """The weights micro-batch `mb` runs with: None, the live parameters."""
        return None

    def graph_for(self, leaves: Mapping[str, Any]) -> tuple[Any, WeightGradStore | None]:
        """The module a training forward runs, and the store its deferred linears fill."""
        return self.call.module, None

    def training_module(self) -> Any:
        """The module a training forward of a stage with inputs to differentiate runs."""
        return self.call.module

    def full(self, mb: int, saved: Saved, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """B of micro-batch `mb`: its input gradients; it is freed."""
        roots, grads = self.roots(saved, output_grads)
        del self.held.saved[mb]
        self.sync.before_backward()
        if roots:
            torch.autograd.backward(roots, grads)
        if saved.store is not None:  # a B after a forward with deferred linears
            saved.store.flush()
        self.held.activations.release(mb)
        return {name: leaf.grad for name, leaf in saved.leaves.items()}

    def inputs(self, mb: int, saved: Saved, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """I of micro-batch `mb`: its input gradients; what W needs stays in `saved`."""
        roots, grads = self.roots(saved, output_grads)
        if saved.store is not None:  # deferred linears: I is an ordinary backward
            return _whole(saved, roots, grads)
        return self._frontier(saved, roots, grads)

    def weights(self, mb: int) -> None:
        """W of micro-batch `mb`: accumulate its parameter gradients and free it."""
        saved = self.held.saved.pop(mb)
        if saved.weight_work is not None:
            split_backward.backward_weight(saved.weight_work)
        if saved.store is not None:
            saved.store.flush()
        self.held.activations.release(mb)

    def roots(self, saved: Saved, output_grads: Mapping[str, Any]) -> tuple[list, list]:
        """Tensors to backpropagate from, and their incoming gradients: the loss and its scale
        on the last stage, else the outputs that received a gradient."""
        if self.loss.computes:
            assert saved.loss is not None, "the last stage's forward computed the loss"
            return [saved.loss], [self.loss.seed(saved.loss)]
        roots, grads = [], []
        for name, out in saved.outputs.items():
            grad = output_grads.get(name)
            if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                roots.append(out)
                grads.append(grad)
        return roots, grads

    def _frontier(self, saved: Saved, roots: list, grads: list) -> dict[str, Any]:
        """I up to the autograd frontier of the inputs; what W needs is kept (split_backward)."""
        names = list(saved.leaves)
        result, saved.weight_work = split_backward.backward_input(
            roots, grads, [saved.leaves[n] for n in names], self.call.params)
        return dict(zip(names, result)) if result else {name: None for name in names}


class SplitBackward(FusedBackward):
    """Zero-bubble I now, W later: a forward with stage inputs to differentiate runs the graph
    with deferred linears, so I is one ordinary backward and W the queued matmuls."""

    def graph_for(self, leaves: Mapping[str, Any]) -> tuple[Any, WeightGradStore | None]:
        """The graph with deferred linears where there are inputs to differentiate (else W is
        the whole backward: there is no I to shorten)."""
        if not (leaves and torch.is_grad_enabled()):
            return self.call.module, None
        return self.call.deferred()

    def training_module(self) -> Any:
        """The graph with deferred linears (a stage with no input to differentiate runs the
        plain one: `graph_for`)."""
        return self.call.deferred()[0] if self.call.grad_inputs else self.call.module


class CompiledBackward(FusedBackward):
    """A compiled stage: its backward is one autograd node, so I runs the whole backward
    (input and weight gradients) and W only frees the micro-batch."""

    def inputs(self, mb: int, saved: Saved, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """I as the whole backward: the weight gradients accumulate now."""
        roots, grads = self.roots(saved, output_grads)
        return _whole(saved, roots, grads)


class VersionedBackward(FusedBackward):
    """Asynchronous schedules: each micro-batch runs with, and differentiates, the weight
    version its forward was given; the gradients wait in `versions` for the next update."""

    def __init__(self, call: StageCall, held: InFlight, loss: StageLoss, sync: Any,
                 versions: WeightVersions):
        super().__init__(call, held, loss, sync)
        self.versions = versions

    def weights_for(self, mb: int) -> dict | None:
        """The stashed version micro-batch `mb` uses (`VersionRule`)."""
        return self.versions.acquire(mb)

    def full(self, mb: int, saved: Saved, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Gradients of this micro-batch's own weight version, kept for the next update."""
        roots, grads = self.roots(saved, output_grads)
        del self.held.saved[mb]
        assert saved.weights is not None, "an asynchronous stage's forward used a version"
        names = list(saved.leaves)
        weights = list(saved.weights)
        wanted = [saved.leaves[n] for n in names] + [saved.weights[n] for n in weights]
        result = (torch.autograd.grad(roots, wanted, grads, allow_unused=True)
                  if roots and wanted else [None] * len(wanted))
        self.versions.accumulate(dict(zip(weights, result[len(names):])))
        self.versions.release(mb)
        self.held.activations.release(mb)
        return dict(zip(names, result[: len(names)]))

    def update(self) -> None:
        """Asynchronous STEP: the optimizer applies the pending gradient to the live weights."""
        self.versions.update()


def _whole(saved: Saved, roots: list, grads: list) -> dict[str, Any]:
    """I as one ordinary backward: a deferred linear queues its weight gradient into
    saved.store; a compiled stage's backward computes both."""
    if roots:
        torch.autograd.backward(roots, grads)
    return {name: leaf.grad for name, leaf in saved.leaves.items()}
