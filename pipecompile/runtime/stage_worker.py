"""StageWorker: forward and backward of one stage for one micro-batch at a time.

A worker keeps, per in-flight micro-batch, the tensors its backward needs: the received inputs
(detached into leaves, so their gradients can be sent back) and the outputs. Nothing here knows
about other stages or transport; the executors move values between workers.

    forward(i, inputs)           -> outputs          saves (leaves, outputs) of micro-batch i
    backward(i, output_grads)    -> input grads      frees micro-batch i
    backward_input(i, grads)     -> input grads      zero-bubble I: keeps the graph for W
    backward_weight(i)                               zero-bubble W: accumulates param .grad

With `checkpoint=True` the forward runs without autograd and keeps only the inputs and the random
state it started from (the CPU generator's and that of each accelerator the stage's tensors live
on), so the recomputation in backward draws the same dropout masks; the backward recomputes the
forward first, then puts the random state back as it found it (as torch.utils.checkpoint does).
Under rng="global" the graph's own random ops do not rely on that state: device threads draw
from the one global generator at once, so the forward's masks are not what replaying its start
state gives. They draw instead from streams seeded by one global draw per forward
(`own_streams`), which the recomputation reuses.

`activations` counts the bytes each micro-batch keeps for backward (`memory.SavedActivations`,
read by `pipe.memory_stats()`); micro-batch 0's forward starts a step and resets the counts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from ..errors import LossError
from ..ir.rng import generator_lock, microbatch, seeded_call
from . import split_backward
from .direct_forward import DirectCalls
from .memory import SavedActivations, inputs_layout, step_started, storage_keys
from .versions import WeightVersions
from .weight_store import WeightGradStore, collecting, defer_weight_grads

__all__ = ["StageWorker", "LossSpec"]


def _collecting(store: WeightGradStore | None) -> Any:
    return contextlib.nullcontext() if store is None else collecting(store)


@dataclass(frozen=True)
class LossSpec:
    """How the last stage turns flat model outputs into a loss."""

    unflatten: Callable[[list], Any]  # flat outputs -> the model's output structure
    loss_fn: Callable[..., torch.Tensor] | None
    scale: float  # each micro-batch loss is multiplied by this before backward (1/m: the mean)
    num_items: Any = None  # a step's num_items_in_batch: loss_fn gets it, losses are summed


@dataclass(frozen=True)
class _RngState:
    """The random state a checkpointed forward started from: the CPU generator's and, per
    accelerator device the stage touches, that device's generator (dropout on a CUDA tensor
    draws from the CUDA generator, not the CPU one)."""

    cpu: torch.Tensor
    device_type: str | None  # "cuda" (or another accelerator), None for a CPU-only stage
    devices: tuple[tuple[int, torch.Tensor], ...]  # (device index, its generator state)

    @classmethod
    def capture(cls, values: Iterable[Any]) -> "_RngState":
        """The current random state of the CPU and of the devices `values`' tensors are on."""
        found = {(v.device.type, v.get_device()) for v in values
                 if isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")}
        types = {kind for kind, _ in found}
        if len(types) > 1:
            raise RuntimeError(f"a stage's tensors are on several device types {sorted(types)}; "
                               f"checkpointing restores the random state of one")
        device_type = types.pop() if types else None
        states: tuple[tuple[int, Any], ...] = ()
        with generator_lock:  # not in the middle of another thread's seeded draw
            if device_type is not None:
                module = torch.get_device_module(device_type)
                states = tuple((i, module.get_rng_state(i)) for i in sorted(i for _, i in found))
            return cls(torch.random.get_rng_state(), device_type, states)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body from this random state; afterwards the state is what it was before.

        Setting and putting back the state hold `generator_lock`, so they never fall between
        another device thread's seed and draw (rng="per-microbatch"); the body does not, so
        stages recompute in parallel."""
        indices = [i for i, _ in self.devices]
        state = contextlib.ExitStack()
        with generator_lock:
            # device_type matters only when indices is non-empty; "cuda" keeps a CPU-only stage
            # from asking an absent accelerator for anything.
            state.enter_context(torch.random.fork_rng(devices=indices,
                                                      device_type=self.device_type or "cuda"))
            torch.random.set_rng_state(self.cpu)
            if self.device_type is not None:
                module = torch.get_device_module(self.device_type)
                for index, saved in self.devices:
                    module.set_rng_state(saved, index)
        try:
            yield
        finally:
            with generator_lock:
                state.close()


@dataclass
class _Saved:
    leaves: dict[str, torch.Tensor]  # received inputs that need a gradient, as leaves
    outputs: dict[str, Any]
    loss: torch.Tensor | None = None
    inputs: dict[str, Any] | None = None  # checkpointing: what to recompute from
    rng: _RngState | None = None  # checkpointing: the random state the forward started from
    target: Any = None  # checkpointing, last stage: the target the loss is recomputed with
    stream: tuple[int, int] = (0, 0)  # checkpointing: `rng.microbatch`'s (index, step)
    weight_work: Any = None  # zero-bubble: what W needs, recorded by I
    store: WeightGradStore | None = None  # zero-bubble, deferred linears: W's queued work
    weights: dict | None = None  # asynchronous schedules: the weight version this mb uses


_ALONE = object()  # a probe of the output structure: is unflatten([x]) just x?


def _is_seeded(module: torch.nn.Module) -> bool:
    """Whether a graph in `module` has random ops seeded per micro-batch (`rng.seeded_call`):
    only those read the `microbatch` context."""
    return any(node.op == "call_function" and node.target is seeded_call
               for m in module.modules() if isinstance(m, torch.fx.GraphModule)
               for node in m.graph.nodes)


@dataclass
class StageWorker:
    """Runs one stage's module; `grad_inputs` names the received values that need gradients."""

    index: int
    module: torch.nn.Module
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    grad_inputs: frozenset[str]
    loss: LossSpec | None = None  # set on the last stage only
    checkpoint: bool = False
    versions: WeightVersions | None = None  # asynchronous schedules: stashed weight versions
    # zero-bubble I runs the whole backward and W only frees: a compiled stage's backward is
    # one autograd node, with no frontier inside it to stop at (runtime/compiled.py)
    fused_backward: bool = False
    # rng="global", checkpointed: the module's random ops are seeded (`rng.seed_random_ops`) and
    # each forward draws their seed from the global generator, so the recomputation redraws the
    # forward's masks whatever other device threads drew from that generator in between
    own_streams: bool = False
    # zero-bubble: forwards that have stage inputs to differentiate run the graph with deferred
    # linears (`weight_store`), so I is one ordinary backward and W the queued matmuls
    split_weights: bool = False
    exclusive_params: frozenset[int] = frozenset()  # ids of parameters no other stage here holds
    # data parallel: turns torch's gradient reduction (FSDP's, or DDP's reducer) on for the
    # step's last backward only (runtime/data_parallel.py)
    sync: Any = None
    _deferred: dict[int, tuple[Any, Any]] = field(default_factory=dict, init=False, repr=False)
    # the storages of the stage's parameters and buffers (not activations), found once: they
    # are updated in place, and an eval-mode or compiled graph shares them
    _state_keys: frozenset[int] | None = field(default=None, init=False, repr=False)
    # per module run (train, eval or compiled graph): (module, whether it is seeded)
    _seeded_of: tuple[Any, bool] = field(default=(None, False), init=False, repr=False)
    # per step and module: the layout key's part that cannot change within a step
    _step_layout: tuple[Any, Any] = field(default=(None, None), init=False, repr=False)
    _scale: tuple[Any, Any] = field(default=(None, None), init=False, repr=False)
    _unflatten: Any = field(default=None, init=False, repr=False)
    _direct: DirectCalls = field(init=False, repr=False)  # training forwards' direct calls
    saved: dict[int, _Saved] = field(default_factory=dict)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # last stage: detached losses
    peak_inflight: int = 0  # most micro-batches held at once (activations saved) so far
    steps: int = 0  # training steps begun (forwards of micro-batch 0): per-step random streams
    activations: SavedActivations = field(default_factory=SavedActivations)  # bytes kept for backward

    @property
    def params(self) -> list[torch.Tensor]:
        seen = {}
        for p in self.module.parameters():
            if p.requires_grad:
                seen[id(p)] = p
        return list(seen.values())

    def __post_init__(self) -> None:
        # The stage's behaviours are picked here, once, not tested on every micro-batch:
        # recomputation (checkpoint) or kept activations; weight versions (asynchronous
        # schedules) or the live weights; the split backward's I (the compiled graph's fused
        # backward, or the autograd frontier split).
        self._forward = self._forward_recomputed if self.checkpoint else self._forward_kept
        self._backward = self._backward_versioned if self.versions is not None \
            else self._backward_fused
        self._input_grads = self._input_grads_fused if self.fused_backward \
            else self._input_grads_split
        self._direct = DirectCalls(f"stage {self.index}")

    def forward(self, mb: int, inputs: Mapping[str, Any], target: Any = None) -> dict[str, Any]:
        """Run micro-batch `mb`; returns the stage outputs (the loss too, on the last stage)."""
        weights = self.versions.acquire(mb) if self.versions is not None else None
        if mb == 0:
            self._begin_step(inputs)
        outputs = self._forward(mb, inputs, target, weights)
        self.peak_inflight = max(self.peak_inflight, len(self.saved))
        return outputs

    def _forward_recomputed(self, mb: int, inputs: Mapping[str, Any], target: Any,
                            weights: dict | None) -> dict[str, Any]:
        """Checkpointing: no autograd graph; the inputs and random state are kept to
        recompute from in backward."""
        rng = _RngState.capture([*inputs.values(), *self.module.parameters(),
                                 *self.module.buffers()])
        stream = (self._forward_seed(), 0) if self.own_streams else (mb, self.steps)
        with torch.no_grad(), microbatch(stream[0], step=stream[1]):
            outputs = self._run(inputs, weights)
        # what a checkpointed stage keeps until backward: the inputs it recomputes from
        self.activations.hold(mb, inputs.values(), self._state(weights))
        self.saved[mb] = _Saved({}, {}, inputs=dict(inputs), rng=rng, target=target,
                                stream=stream, weights=weights)
        if self.loss is not None:
            with torch.no_grad():
                self.losses[mb] = self._loss(outputs, target)
        return dict(zip(self.output_names, outputs))

    def _forward_kept(self, mb: int, inputs: Mapping[str, Any], target: Any,
                      weights: dict | None) -> dict[str, Any]:
        """The autograd graph is kept until backward; its saved bytes are counted (by layout:
        a forward like one counted before reuses that count without hooks)."""
        leaves = self._leaves(inputs)
        module, store = self._weight_split(leaves)
        layout = self._layout(module, inputs, target) if weights is None else None
        known = self.activations.known(layout)
        if known is None:
            with self.activations.record(mb, self._state(weights), layout):
                saved = self._keep(mb, module, inputs, leaves, target, weights, store)
        else:
            saved = self._keep(mb, module, inputs, leaves, target, weights, store)
            self.activations.add_known(mb, known)
        if saved.loss is not None:
            self.losses[mb] = saved.loss.detach()
        self.saved[mb] = saved
        return saved.outputs

    def _keep(self, mb: int, module: Any, inputs: Mapping[str, Any], leaves: dict,
              target: Any, weights: dict | None, store: WeightGradStore | None) -> _Saved:
        """Run the forward (and the loss) with autograd recording what backward needs."""
        given = {**inputs, **leaves} if leaves else inputs
        if store is not None or self._seeded(module):
            with microbatch(mb, step=self.steps), _collecting(store):
                outputs = self._run(given, weights, module)
        else:  # no seeded random op and no deferred linear: no context to enter
            outputs = self._run(given, weights, module)
        saved = _Saved(leaves, dict(zip(self.output_names, outputs)), weights=weights,
                       store=store)
        if self.loss is not None:
            saved.loss = self._loss(outputs, target)
        return saved

    def infer(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Forward without keeping anything for backward (forward-only calls)."""
        return dict(zip(self.output_names, self._run(inputs, direct=False)))

    def loss_of(self, outputs: Mapping[str, Any], target: Any) -> torch.Tensor:
        """The last stage's loss of `outputs` (by output name), e.g. of an `infer` result."""
        return self._loss(tuple(outputs[n] for n in self.output_names), target)

    def backward(self, mb: int, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Full backward of micro-batch `mb`: accumulates parameter grads, returns input grads."""
        saved = self._restore(mb)
        roots, grads = self._roots(saved, output_grads)
        del self.saved[mb]
        return self._backward(mb, saved, roots, grads)

    def _backward_fused(self, mb: int, saved: _Saved, roots: list, grads: list
                        ) -> dict[str, Any]:
        """One autograd backward: parameter gradients accumulate into `.grad`."""
        if self.sync is not None:
            self.sync.before_backward()
        if roots:
            torch.autograd.backward(roots, grads)
        if saved.store is not None:  # a fused B after a forward with deferred linears
            saved.store.flush()
        self.activations.release(mb)
        return {name: leaf.grad for name, leaf in saved.leaves.items()}

    def _backward_versioned(self, mb: int, saved: _Saved, roots, grads) -> dict[str, Any]:
        """Gradients of this micro-batch's own weight version, kept for the next update."""
        assert saved.weights is not None and self.versions is not None, "an asynchronous stage"
        names = list(saved.leaves)
        weights = list(saved.weights)
        wanted = [saved.leaves[n] for n in names] + [saved.weights[n] for n in weights]
        result = (torch.autograd.grad(roots, wanted, grads, allow_unused=True)
                  if roots and wanted else [None] * len(wanted))
        self.versions.accumulate(dict(zip(weights, result[len(names):])))
        self.versions.release(mb)
        self.activations.release(mb)
        return dict(zip(names, result[: len(names)]))

    def apply_update(self) -> None:
        """Asynchronous STEP: the optimizer applies the pending gradient to the live weights."""
        assert self.versions is not None, "STEP with a micro-batch runs on asynchronous stages"
        self.versions.update()

    def backward_input(self, mb: int, output_grads: Mapping[str, Any]) -> dict[str, Any]:
        """Zero-bubble I: gradients of the inputs only; records what `backward_weight` needs."""
        saved = self._restore(mb)
        roots, grads = self._roots(saved, output_grads)
        if saved.store is not None:  # deferred linears: I is an ordinary backward
            return self._input_grads_fused(saved, roots, grads)
        return self._input_grads(saved, roots, grads)

    def _input_grads_fused(self, saved: _Saved, roots: list, grads: list) -> dict[str, Any]:
        """I as one ordinary backward: a deferred linear queues its weight gradient into
        saved.store; a compiled stage's backward is one node and computes both (W frees)."""
        if roots:
            torch.autograd.backward(roots, grads)
        return {name: leaf.grad for name, leaf in saved.leaves.items()}

    def _input_grads_split(self, saved: _Saved, roots: list, grads: list) -> dict[str, Any]:
        """I up to the autograd frontier of the inputs; what W needs is kept (split_backward)."""
        names = list(saved.leaves)
        result, saved.weight_work = split_backward.backward_input(
            roots, grads, [saved.leaves[n] for n in names], self.params)
        return dict(zip(names, result)) if result else {name: None for name in names}

    def backward_weight(self, mb: int) -> None:
        """Zero-bubble W: accumulate the parameter gradients of micro-batch `mb` and free it."""
        saved = self.saved.pop(mb)
        if saved.weight_work is not None:
            split_backward.backward_weight(saved.weight_work)
        if saved.store is not None:
            saved.store.flush()
        self.activations.release(mb)

    def _begin_step(self, inputs: Mapping[str, Any]) -> None:
        """The first forward of a step (micro-batch 0): new random streams and memory counts."""
        self.steps += 1
        self.activations.reset()
        if self.sync is not None:
            self.sync.begin_step()
        tensors = [*inputs.values(), *self.module.parameters()]
        step_started({t.device for t in tensors if isinstance(t, torch.Tensor)}, self.steps)

    def _layout(self, module: torch.nn.Module, inputs: Mapping[str, Any], target: Any) -> Any:
        """A key under which a training forward saves the same tensors for backward (what
        `SavedActivations.record` reuses a count by), or None when the inputs are not all
        plain. Inputs that share a storage are part of it, as are autocast, grad mode and which
        of the module's parameters are trainable (those cannot change within a step, so they
        are read once per step). The captured graph is static; the last stage's loss_fn is
        taken to save the same tensors for targets of the same layout too."""
        given = inputs_layout(inputs, target)
        if given is None:
            return None
        key, fixed = self._step_layout
        if key != (self.steps, module):
            types = sorted({v.device.type for v in inputs.values()
                            if isinstance(v, torch.Tensor)} | {"cpu"})
            autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t))
                             for t in types)
            fixed = (module, autocast, tuple(p.requires_grad for p in module.parameters()))
            self._step_layout = ((self.steps, module), fixed)
        return (fixed, given)

    def _seeded(self, module: torch.nn.Module) -> bool:
        known, seeded = self._seeded_of
        if known is not module:
            seeded = _is_seeded(module)
            self._seeded_of = (module, seeded)
        return seeded

    def _scale_of(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss's incoming gradient, the loss scale, made once per scale, dtype and device
        (autograd reads it and never writes it; held here, it is never stolen into a .grad)."""
        assert self.loss is not None, "only the last stage computes the loss"
        key = (self.loss.scale, loss.dtype, loss.device)
        if self._scale[0] != key:
            self._scale = (key, torch.full((), self.loss.scale, dtype=loss.dtype,
                                           device=loss.device))
        return self._scale[1]

    def _state(self, weights: dict | None) -> frozenset[int]:
        """The storages of the parameters and buffers (and a stashed weight version): what
        saved-activation counting leaves out."""
        if self._state_keys is None:
            self._state_keys = storage_keys([*self.module.parameters(), *self.module.buffers()])
        return self._state_keys | storage_keys(weights.values()) if weights else self._state_keys

    # -- helpers ---------------------------------------------------------------------------

    def _forward_seed(self) -> int:
        """One draw from the global generator: the seed of this forward's random streams."""
        with generator_lock:
            return int(torch.randint(0, 2**62, (), dtype=torch.int64))

    def _run(self, inputs: Mapping[str, Any], weights: dict | None = None,
             module: Any = None, direct: bool = True) -> tuple:
        """The stage's forward; a training forward calls the graph's direct forward."""
        args = [inputs[n] for n in self.input_names]
        if weights is not None:  # a stashed version, without touching the live parameters
            return tuple(torch.func.functional_call(self.module, weights, tuple(args)))
        if direct:
            return tuple(self._direct(module or self.module, args, self.steps))
        return tuple((module or self.module)(*args))

    def _weight_split(self, leaves: Mapping[str, Any]) -> tuple[Any, WeightGradStore | None]:
        """The module a training forward runs, and the store its deferred linears fill: the
        graph with deferred linears where the stage splits I from W and has inputs to
        differentiate (else W is the whole backward: there is no I to shorten)."""
        if not (self.split_weights and leaves and torch.is_grad_enabled()):
            return self.module, None
        known = self._deferred.get(id(self.module))
        if known is None or known[0] is not self.module:
            graph = self.module if isinstance(self.module, torch.fx.GraphModule) else None
            known = (self.module, graph and defer_weight_grads(graph))
            self._deferred[id(self.module)] = known
        if known[1] is None:
            return self.module, None
        return known[1], WeightGradStore(self.exclusive_params)

    def _leaves(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        leaves = {}
        for name in self.input_names:
            value = inputs[name]
            if name in self.grad_inputs and isinstance(value, torch.Tensor):
                leaves[name] = value.detach().requires_grad_(value.is_floating_point())
        return {n: t for n, t in leaves.items() if t.requires_grad}

    def _loss(self, outputs: tuple, target: Any) -> torch.Tensor:
        spec = self.loss
        assert spec is not None, "only the last stage computes the loss"
        if self._unflatten is None:  # one output that is the whole result: no pytree walk
            single = len(outputs) == 1 and spec.unflatten([_ALONE]) is _ALONE
            self._unflatten = (lambda flat: flat[0]) if single else spec.unflatten
        result = self._unflatten(list(outputs))
        if spec.loss_fn is None:
            loss = result
        elif spec.num_items is not None:
            loss = spec.loss_fn(result, target, num_items_in_batch=spec.num_items)
        else:
            loss = spec.loss_fn(result, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
            source = "loss_fn" if spec.loss_fn is not None else "the model (no loss_fn given)"
            raise LossError(
                f"{source} returned {what}, not a scalar tensor; return a 0-dim loss "
                f"(e.g. reduce with .mean()) or pass loss_fn=... to compile()"
            )
        return loss

    def _restore(self, mb: int) -> _Saved:
        """The saved state of `mb`; under checkpointing, the recomputed forward."""
        saved = self.saved[mb]
        if saved.inputs is None:
            return saved
        assert saved.rng is not None, "a checkpointed forward saves its random state"
        # the recomputed forward's saved tensors are held on top of the inputs until backward
        with saved.rng.restored(), self.activations.record(mb, self._state(saved.weights)):
            leaves = self._leaves(saved.inputs)
            module, store = self._weight_split(leaves)
            with microbatch(saved.stream[0], step=saved.stream[1]), _collecting(store):
                outputs = self._run({**saved.inputs, **leaves}, saved.weights, module)
            recomputed = _Saved(leaves, dict(zip(self.output_names, outputs)),
                                weights=saved.weights, store=store)
            if self.loss is not None:
                recomputed.loss = self._loss(outputs, saved.target)
        self.saved[mb] = recomputed
        return recomputed

    def _roots(self, saved: _Saved, output_grads: Mapping[str, Any]) -> tuple[list, list]:
        """Tensors to backpropagate from, and their incoming gradients."""
        if self.loss is not None:
            assert saved.loss is not None, "the last stage's forward computed the loss"
            # d(scale * loss) = scale * d(loss): the scale as the loss's incoming gradient
            # gives the same gradients (the mul's backward multiplies 1 by it) with no extra op
            return [saved.loss], [self._scale_of(saved.loss)]
        roots, grads = [], []
        for name, out in saved.outputs.items():
            grad = output_grads.get(name)
            if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                roots.append(out)
                grads.append(grad)
        return roots, grads
