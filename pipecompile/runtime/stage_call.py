"""StageCall: how one stage's module is called, and what that needs found once, not per call.

    call.run(inputs, step=k)            the training forward: the graph's direct calls
    call.run(inputs, weights)           a stashed weight version (`torch.func.functional_call`)
    call.run(inputs, direct=False)      the module itself (forward-only calls)
    call.leaves(inputs)                 received inputs to differentiate, detached into leaves
    call.deferred()                     the graph with deferred linears and a store for W
                                        (zero-bubble: `weight_store.py`)

`module` may be replaced (train and eval graphs, `Runtime.set_training`); every cache here is
keyed by the module it was found for. The layout key, the seeded test and the parameters'
storages are what per-micro-batch work would otherwise redo (`SavedActivations.record` reuses
a count by the layout key).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..ir.rng import module_seed, seeded_call
from .direct_forward import DirectCalls
from .memory import inputs_layout, storage_keys
from .weight_store import WeightGradStore, defer_weight_grads

__all__ = ["StageCall"]


def _is_seeded(module: torch.nn.Module) -> bool:
    """Whether a graph in `module` has random ops seeded per micro-batch (`rng.seeded_call`, or
    an opaque module run seeded): only those read the `microbatch` context."""
    return any(module_seed(m) is not None for m in module.modules()) or any(
        node.op == "call_function" and node.target is seeded_call
        for m in module.modules() if isinstance(m, torch.fx.GraphModule)
        for node in m.graph.nodes)


class StageCall:
    """Calls stage `index`'s module on values by name; `grad_inputs` names the received values
    that need gradients, `exclusive_params` the parameters no other stage here holds (a
    deferred W may add into their .grad in place)."""

    def __init__(self, index: int, module: torch.nn.Module, input_names: tuple[str, ...],
                 output_names: tuple[str, ...], grad_inputs: frozenset[str],
                 exclusive_params: frozenset[int] = frozenset()):
        self.index = index
        self.module = module
        self.input_names = input_names
        self.output_names = output_names
        self.grad_inputs = grad_inputs
        self.exclusive_params = exclusive_params
        self.direct = DirectCalls(f"stage {index}")  # training forwards' direct calls
        self._deferred: dict[int, tuple[Any, Any]] = {}  # id(module) -> (module, its graph)
        # the storages of the stage's parameters and buffers (not activations), found once:
        # they are updated in place, and an eval-mode or compiled graph shares them
        self._state_keys: frozenset[int] | None = None
        self._seeded_of: tuple[Any, bool] = (None, False)  # (module, whether it is seeded)
        self._step_layout: tuple[Any, Any] = (None, None)  # per step and module: fixed part

    @property
    def params(self) -> list[torch.Tensor]:
        """The module's trainable parameters, each once."""
        seen = {}
        for p in self.module.parameters():
            if p.requires_grad:
                seen[id(p)] = p
        return list(seen.values())

    def run(self, inputs: Mapping[str, Any], weights: dict | None = None, module: Any = None,
            *, step: int = 0, direct: bool = True) -> tuple:
        """The stage's forward on `inputs` (by name); a training forward calls the graph's
        direct forward, checked valid once per `step`."""
        args = [inputs[n] for n in self.input_names]
        if weights is not None:  # a stashed version, without touching the live parameters
            return tuple(torch.func.functional_call(self.module, weights, tuple(args)))
        if direct:
            return tuple(self.direct(module or self.module, args, step))
        return tuple((module or self.module)(*args))

    def named(self, outputs: tuple) -> dict[str, Any]:
        """Flat outputs by output name."""
        return dict(zip(self.output_names, outputs))

    def leaves(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The received inputs that need a gradient, detached into leaves that require one."""
        leaves = {}
        for name in self.input_names:
            value = inputs[name]
            if name in self.grad_inputs and isinstance(value, torch.Tensor):
                leaves[name] = value.detach().requires_grad_(value.is_floating_point())
        return {n: t for n, t in leaves.items() if t.requires_grad}

    def deferred(self) -> tuple[Any, WeightGradStore | None]:
        """The module with deferred linears and a fresh store for its weight gradients, or the
        module and None where there is no graph (a compiled stage) or no linear to defer."""
        known = self._deferred.get(id(self.module))
        if known is None or known[0] is not self.module:
            graph = self.module if isinstance(self.module, torch.fx.GraphModule) else None
            known = (self.module, graph and defer_weight_grads(graph))
            self._deferred[id(self.module)] = known
        if known[1] is None:
            return self.module, None
        return known[1], WeightGradStore(self.exclusive_params)

    def seeded(self, module: torch.nn.Module) -> bool:
        """Whether `module` has random ops seeded per micro-batch (found once per module)."""
        known, seeded = self._seeded_of
        if known is not module:
            seeded = _is_seeded(module)
            self._seeded_of = (module, seeded)
        return seeded

    def state(self, weights: dict | None) -> frozenset[int]:
        """The storages of the parameters and buffers (and a stashed weight version): what
        saved-activation counting leaves out."""
        if self._state_keys is None:
            self._state_keys = storage_keys([*self.module.parameters(), *self.module.buffers()])
        return self._state_keys | storage_keys(weights.values()) if weights else self._state_keys

    def layout(self, module: torch.nn.Module, inputs: Mapping[str, Any], target: Any,
               step: int) -> Any:
        """A key under which a training forward saves the same tensors for backward, or None
        when the inputs are not all plain. Inputs that share a storage are part of it, as are
        autocast, grad mode and which of the module's parameters are trainable (those cannot
        change within a step, so they are read once per step). The captured graph is static;
        the last stage's loss_fn is taken to save the same tensors for targets of the same
        layout too."""
        given = inputs_layout(inputs, target)
        if given is None:
            return None
        key, fixed = self._step_layout
        if key != (step, module):
            types = sorted({v.device.type for v in inputs.values()
                            if isinstance(v, torch.Tensor)} | {"cpu"})
            autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                             for t in types)
            fixed = (module, autocast, tuple(p.requires_grad for p in module.parameters()))
            self._step_layout = ((step, module), fixed)
        return (fixed, given)
