"""StageWorker: one stage's behaviours, chosen once, run one micro-batch at a time.

The worker owns no forward or backward logic of its own: when it is assembled it picks one
behaviour of each kind from its options, and each call goes to that behaviour.

    forward          KeptForward | RecomputedForward                    (forwards.py)
    backward         FusedBackward | SplitBackward | CompiledBackward
                     | VersionedBackward                                 (backwards.py)
    gradient hooks   NoSync | MicrobatchSync (FSDP) | ReplicaSync (DDP) (data_parallel.py)

    forward(i, inputs)           -> outputs          saves what micro-batch i's backward needs
    backward(i, output_grads)    -> input grads      B: frees micro-batch i
    backward_input(i, grads)     -> input grads      zero-bubble I: keeps what W needs
    backward_weight(i)                               zero-bubble W: accumulates param .grad

What the runtime asks of it between calls goes through its own methods, never by setting its
fields from outside: `begin_call` (before a run), `use_module` (train/eval graphs),
`scaled_loss` (a loss scale or num_items for one step), `take_losses` (the step's losses).

The generated code of each device row (`codegen.py`) names the behaviours of its stages
(`behaviours`). The parts the behaviours share: `StageCall` (how the module is called),
`InFlight` (the saved micro-batches, losses and activation bytes: `activations`, read by
`pipe.memory_stats()`) and `StageLoss` (the last stage's loss).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import torch

from .backwards import CompiledBackward, FusedBackward, SplitBackward, VersionedBackward
from .direct_forward import DirectCalls, direct_forward, plain_call
from .forwards import KeptForward, RecomputedForward
from .in_flight import InFlight, NoSync, Saved
from .memory import SavedActivations
from .rng_state import RngState as _RngState  # noqa: F401 - its old home (tests, tools)
from .stage_call import StageCall
from .stage_loss import LossSpec, StageLoss
from .versions import WeightVersions

__all__ = ["StageWorker", "LossSpec"]


class StageWorker:
    """Runs one stage's module; `grad_inputs` names the received values that need gradients.

    Options (each picks a behaviour): `loss` on the last stage only; `checkpoint`: recompute
    in backward; `versions`: asynchronous schedules' stashed weight versions; `fused_backward`:
    a compiled stage, whose backward is one autograd node; `own_streams` (rng="global",
    checkpointed): the module's random ops are seeded per forward; `split_weights`
    (zero-bubble): forwards defer their linears' weight gradients to W; `sync`: data-parallel
    gradient hooks, armed for the step's last backward (runtime/data_parallel.py).
    `exclusive_params`: ids of parameters no other stage here holds."""

    def __init__(self, index: int, module: torch.nn.Module, input_names: tuple[str, ...],
                 output_names: tuple[str, ...], grad_inputs: frozenset[str],
                 loss: LossSpec | None = None, checkpoint: bool = False,
                 versions: WeightVersions | None = None, *, fused_backward: bool = False,
                 own_streams: bool = False, split_weights: bool = False,
                 exclusive_params: frozenset[int] = frozenset(), sync: Any = None,
                 vocab_loss: Any = None):
        self.index = index
        self.call = StageCall(index, module, input_names, output_names, grad_inputs,
                              exclusive_params)
        self.held = InFlight()
        self._loss = StageLoss(loss, vocab_loss if loss is not None else None)
        self.checkpoint = checkpoint
        self.versions = versions
        self.fused_backward = fused_backward
        self.own_streams = own_streams
        self._split_weights = split_weights
        self._sync = sync
        self._choose()

    def _choose(self) -> None:
        """Pick the behaviours from the options, once (again only if an option changes)."""
        sync = self._sync if self._sync is not None else NoSync()
        parts = (self.call, self.held, self._loss, sync)
        backward: FusedBackward
        if self.versions is not None:
            backward = VersionedBackward(*parts, self.versions)
        elif self.fused_backward:
            backward = CompiledBackward(*parts)
        elif self._split_weights:
            backward = SplitBackward(*parts)
        else:
            backward = FusedBackward(*parts)
        self.backward_behaviour = backward
        self.forward_behaviour: KeptForward | RecomputedForward = (
            RecomputedForward(*parts[:3], backward, sync, own_streams=self.own_streams)
            if self.checkpoint else KeptForward(*parts[:3], backward, sync))

    @property
    def behaviours(self) -> tuple[str, ...]:
        """The names of the chosen behaviours: forward, backward and (data parallel) the
        gradient hooks, as the generated code names them."""
        names = (type(self.forward_behaviour).__name__, type(self.backward_behaviour).__name__)
        return names + ((type(self._sync).__name__,) if self._sync is not None else ())

    # -- the calls a generated row makes ---------------------------------------------------

    def forward(self, mb: int, inputs: Mapping[str, Any], target: Any = None) -> dict[str, Any]:
        """Run micro-batch `mb`; returns the stage outputs (the loss too, on the last stage)."""
        return self.forward_behaviour(mb, inputs, target)

    def backward(self, mb: int, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Full backward of micro-batch `mb`: accumulates parameter grads, returns input grads."""
        return self.backward_behaviour.full(mb, self.forward_behaviour.restore(mb), output_grads)

    def backward_input(self, mb: int, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Zero-bubble I: gradients of the inputs only; records what `backward_weight` needs."""
        return self.backward_behaviour.inputs(mb, self.forward_behaviour.restore(mb),
                                              output_grads)

    def backward_weight(self, mb: int) -> None:
        """Zero-bubble W: accumulate the parameter gradients of micro-batch `mb` and free it."""
        self.backward_behaviour.weights(mb)

    def apply_update(self) -> None:
        """Asynchronous STEP: the optimizer applies the pending gradient to the live weights."""
        backward = self.backward_behaviour
        assert isinstance(backward, VersionedBackward), "STEP with a micro-batch: async stages"
        backward.update()

    def infer(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Forward without keeping anything for backward (forward-only calls)."""
        return self.call.named(self.call.run(inputs, direct=False))

    @property
    def loss_vocab(self) -> Any:
        """The last stage's `VocabLoss` (runtime/vocab_loss.py): how its loss reads split
        logits; None where no output is split."""
        return self._loss.vocab

    def loss_of(self, outputs: Mapping[str, Any], target: Any) -> torch.Tensor:
        """The last stage's loss of `outputs` (by output name), e.g. of an `infer` result."""
        return self._loss(tuple(outputs[n] for n in self.output_names), target)

    # -- what a step or a mode switch asks of the worker ----------------------------------

    def begin_call(self, *, summed: bool) -> None:
        """Before a run of a schedule: peak in-flight counted afresh, an asynchronous stage's
        weight versions told a call begins, the gradient hooks told whether the step's
        gradients are sums (`num_items`) or means."""
        self.held.peak_inflight = 0
        if self.versions is not None:
            self.versions.begin_call()
        if self._sync is not None:
            self._sync.summed(summed)

    def use_module(self, module: torch.nn.Module) -> None:
        """Run `module` from now on (the runtime's train/eval switch: `stage_modes.py`)."""
        self.call.module = module

    def take_losses(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """The last stage's losses of micro-batches `indices`, in that order, no longer held."""
        return [self.held.losses.pop(i) for i in indices]

    @contextlib.contextmanager
    def scaled_loss(self, loss_scale: float | None, num_items: Any = None) -> Iterator[None]:
        """The last stage's loss multiplied by `loss_scale` before backward (a GradScaler's
        scale) and, with `num_items`, summed over micro-batches rather than averaged, for the
        body; the loss spec as before afterwards. Nothing changes on other stages."""
        spec = self._loss.spec
        if (loss_scale is None and num_items is None) or spec is None:
            yield
            return
        scale = 1.0 if num_items is not None else spec.scale  # a sum, not a mean
        self._loss.spec = replace(spec, scale=scale * (loss_scale or 1.0), num_items=num_items)
        try:
            yield
        finally:
            self._loss.spec = spec

    def forward_code(self) -> str:
        """The Python a training forward of this stage runs: the graph's direct calls (under
        a split backward, of the graph with deferred linears), or the module's own code where
        it is called as a module (a weight version, hooks, a compiled stage)."""
        module = self.backward_behaviour.training_module()
        if self.versions is None and plain_call(module):
            direct = direct_forward(module, f"stage {self.index}")
            if direct is not None:
                return direct.source
        return module.code if isinstance(module, torch.fx.GraphModule) else repr(module)

    # -- options and state, as the runtime and tools read them -----------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The module training forwards run (the runtime swaps in eval graphs and back)."""
        return self.call.module

    @module.setter
    def module(self, module: torch.nn.Module) -> None:
        self.call.module = module

    @property
    def loss(self) -> LossSpec | None:
        """The last stage's loss spec (a step may replace it: a loss scale, num_items)."""
        return self._loss.spec

    @loss.setter
    def loss(self, spec: LossSpec | None) -> None:
        self._loss.spec = spec

    @property
    def split_weights(self) -> bool:
        """Whether forwards defer their linears' weight gradients (zero-bubble)."""
        return self._split_weights

    @split_weights.setter
    def split_weights(self, value: bool) -> None:
        self._split_weights = value
        self._choose()

    @property
    def sync(self) -> Any:
        """The data-parallel gradient hooks given (None: not data parallel)."""
        return self._sync

    @sync.setter
    def sync(self, sync: Any) -> None:
        self._sync = sync
        self._choose()

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.call.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.call.output_names

    @property
    def grad_inputs(self) -> frozenset[str]:
        return self.call.grad_inputs

    @property
    def exclusive_params(self) -> frozenset[int]:
        return self.call.exclusive_params

    @property
    def params(self) -> list[torch.Tensor]:
        return self.call.params

    @property
    def saved(self) -> dict[int, Saved]:
        return self.held.saved

    @property
    def losses(self) -> dict[int, torch.Tensor]:
        return self.held.losses

    @property
    def activations(self) -> SavedActivations:
        return self.held.activations

    @property
    def steps(self) -> int:
        return self.held.steps

    @property
    def peak_inflight(self) -> int:
        return self.held.peak_inflight

    @peak_inflight.setter
    def peak_inflight(self, value: int) -> None:
        self.held.peak_inflight = value

    @property
    def _direct(self) -> DirectCalls:
        return self.call.direct

    def __repr__(self) -> str:
        return f"StageWorker({self.index}, {', '.join(self.behaviours)})"
