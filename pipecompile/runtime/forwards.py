"""A stage's training-forward behaviours, one chosen per stage when its worker is assembled.

    KeptForward        the autograd graph is kept until backward; its saved bytes are counted
                       (by layout: a forward like one counted before reuses that count)
    RecomputedForward  checkpointing: no autograd graph; the inputs and the random state the
                       forward started from are kept, and backward recomputes the forward from
                       them first (`restore`), drawing the same dropout masks

Under rng="global" a graph's random ops do not rely on that state: device threads draw from the
one global generator at once, so the forward's masks are not what replaying its start state
gives. They draw instead from streams seeded by one global draw per forward (`own_streams`,
`rng.seed_random_ops`), which the recomputation reuses.

Both take the weights and the graph to record from the stage's backward behaviour
(`backwards.py`): a weight version (asynchronous schedules), deferred linears (zero-bubble).
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch

from ..ir.rng import generator_lock, microbatch
from .backwards import FusedBackward
from .in_flight import InFlight, Saved
from .rng_state import RngState
from .stage_call import StageCall
from .stage_loss import StageLoss
from .weight_store import WeightGradStore, collecting

__all__ = ["KeptForward", "RecomputedForward"]


def _collecting(store: WeightGradStore | None) -> Any:
    return contextlib.nullcontext() if store is None else collecting(store)


class _Forward:
    """A training forward of one micro-batch; what it keeps for backward is the subclass's."""

    def __init__(self, call: StageCall, held: InFlight, loss: StageLoss,
                 backward: FusedBackward, sync: Any):
        self.call, self.held, self.loss, self.backward, self.sync = (call, held, loss,
                                                                     backward, sync)

    def __call__(self, mb: int, inputs: Mapping[str, Any], target: Any = None
                 ) -> dict[str, Any]:
        """Run micro-batch `mb`; the stage outputs by name. Micro-batch 0 begins a step."""
        weights = self.backward.weights_for(mb)
        if mb == 0:
            self.held.begin_step(inputs, self.call.module, self.sync)
        outputs = self.run(mb, inputs, target, weights)
        self.held.peak_inflight = max(self.held.peak_inflight, len(self.held.saved))
        return outputs

    def run(self, mb: int, inputs: Mapping[str, Any], target: Any,
            weights: dict | None) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, mb: int) -> Saved:
        """What micro-batch `mb`'s backward starts from."""
        return self.held.saved[mb]

    def _run(self, inputs: Mapping[str, Any], weights: dict | None, module: Any = None) -> tuple:
        if self.loss.computes:  # split logits stay this rank's slices for the loss to read
            with self.loss.producing():
                return self.call.run(inputs, weights, module, step=self.held.steps)
        return self.call.run(inputs, weights, module, step=self.held.steps)


class KeptForward(_Forward):
    """The autograd graph is kept until backward; its saved bytes are counted."""

    def run(self, mb: int, inputs: Mapping[str, Any], target: Any,
            weights: dict | None) -> dict[str, Any]:
        """Run with autograd; counts the bytes kept (by layout: a forward like one counted
        before reuses that count without hooks)."""
        call, held = self.call, self.held
        leaves = call.leaves(inputs)
        module, store = self.backward.graph_for(leaves)
        layout = call.layout(module, inputs, target, held.steps) if weights is None else None
        known = held.activations.known(layout)
        if known is None:
            with held.activations.record(mb, call.state(weights), layout):
                saved = self._keep(mb, module, inputs, leaves, target, weights, store)
        else:
            saved = self._keep(mb, module, inputs, leaves, target, weights, store)
            held.activations.add_known(mb, known)
        if saved.loss is not None:
            held.losses[mb] = saved.loss.detach()
        held.saved[mb] = saved
        return saved.outputs

    def _keep(self, mb: int, module: Any, inputs: Mapping[str, Any], leaves: dict,
              target: Any, weights: dict | None, store: WeightGradStore | None) -> Saved:
        """Run the forward (and the loss) with autograd recording what backward needs."""
        given = {**inputs, **leaves} if leaves else inputs
        if store is not None or self.call.seeded(module):
            with microbatch(mb, step=self.held.steps), _collecting(store):
                outputs = self._run(given, weights, module)
        else:  # no seeded random op and no deferred linear: no context to enter
            outputs = self._run(given, weights, module)
        saved = Saved(leaves, self.call.named(outputs), weights=weights, store=store)
        if self.loss.computes:
            saved.loss = self.loss(outputs, target, local=True)
        return saved


class RecomputedForward(_Forward):
    """Checkpointing: no autograd graph now; backward recomputes it from the kept inputs and
    random state (`own_streams`: from the seed this forward drew for its random ops)."""

    def __init__(self, call: StageCall, held: InFlight, loss: StageLoss,
                 backward: FusedBackward, sync: Any, *, own_streams: bool = False):
        super().__init__(call, held, loss, backward, sync)
        self.own_streams = own_streams

    def run(self, mb: int, inputs: Mapping[str, Any], target: Any,
            weights: dict | None) -> dict[str, Any]:
        """Run without autograd; keep the inputs and random state to recompute from."""
        call, held = self.call, self.held
        rng = RngState.capture([*inputs.values(), *call.module.parameters(),
                                *call.module.buffers()])
        stream = (_forward_seed(), 0) if self.own_streams else (mb, held.steps)
        with torch.no_grad(), microbatch(stream[0], step=stream[1]):
            outputs = self._run(inputs, weights)
        # what a recomputed stage keeps until backward: the inputs it recomputes from
        held.activations.hold(mb, inputs.values(), call.state(weights))
        held.saved[mb] = Saved({}, {}, inputs=dict(inputs), rng=rng, target=target,
                               stream=stream, weights=weights)
        if self.loss.computes:
            with torch.no_grad():
                held.losses[mb] = self.loss(outputs, target, local=True)
        return call.named(outputs)

    def restore(self, mb: int) -> Saved:
        """The recomputed forward of `mb`, from its start state; it replaces the saved inputs."""
        call, held = self.call, self.held
        saved = held.saved[mb]
        if saved.inputs is None:  # nothing to recompute from
            return saved
        assert saved.rng is not None, "a recomputed forward saves its random state"
        # the recomputed forward's saved tensors are held on top of the inputs until backward
        with saved.rng.restored(), held.activations.record(mb, call.state(saved.weights)):
            leaves = call.leaves(saved.inputs)
            module, store = self.backward.graph_for(leaves)
            with microbatch(saved.stream[0], step=saved.stream[1]), _collecting(store):
                outputs = self._run({**saved.inputs, **leaves}, saved.weights, module)
            recomputed = Saved(leaves, call.named(outputs), weights=saved.weights, store=store)
            if self.loss.computes:
                recomputed.loss = self.loss(outputs, saved.target, local=True)
        held.saved[mb] = recomputed
        return recomputed


def _forward_seed() -> int:
    """One draw from the global generator: the seed of this forward's random streams."""
    with generator_lock:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))
