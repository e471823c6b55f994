"""Pipeline: the compiled, runnable program returned by `pipecompile.compile`.

It owns the `StagedProgram` (stages and wiring), the schedule, one `StageWorker` per stage, the
per-stage optimizers and the executor; it offers the user-facing API of DESIGN.md:
`pipe(*args)`, `pipe.step(*args, target=y)`, `named_parameters()`, `state_dict()`, printing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from .capture import batch_size_of
from .errors import ConfigError
from .passes.split import Stage, StagedProgram
from .report import explain_passes, stage_table
from .runtime.actions import Schedule
from .runtime.local import LocalExecutor, Wiring
from .runtime.microbatch import split_microbatches
from .runtime.simulate import Timeline
from .runtime.stage_worker import LossSpec, StageWorker

__all__ = ["Pipeline", "PassRecord"]


@dataclass(frozen=True)
class PassRecord:
    """What one compiler pass did: its name, wall time and a one-line summary."""

    name: str
    seconds: float
    summary: str


class Pipeline:
    """A model split into pipeline stages, trained by interpreting a schedule."""

    def __init__(
        self,
        program: StagedProgram,
        schedule: Schedule,
        *,
        microbatches: int,
        loss_fn: Callable | None,
        optimizer: Callable | None,
        checkpoint: bool,
        predicted: Timeline | None,
        passes: Sequence[PassRecord],
        timeout: float = 300.0,
    ):
        self.program = program
        self.schedule = schedule
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.predicted = predicted
        self.passes = tuple(passes)
        captured = program.captured
        grad_values = _values_needing_grad(program)
        loss = LossSpec(captured.unflatten_outputs, loss_fn, 1.0 / microbatches)
        last = program.num_stages - 1
        self.workers = [
            StageWorker(s.index, s.module, s.inputs, s.outputs,
                        frozenset(n for n in s.inputs if n in grad_values),
                        loss if s.index == last else None, checkpoint)
            for s in program.stages
        ]
        wiring = Wiring(program.producer, program.consumers, captured.input_names,
                        tuple(s.device for s in program.stages))
        self.executor = LocalExecutor(self.workers, wiring, timeout=timeout)
        self.optimizers = _build_optimizers(program, optimizer)

    # -- the model's API ------------------------------------------------------------------

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.program.stages

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, stage after stage on the whole batch: returns what the model returns.

        A model captured with static shapes runs in chunks of its captured batch size, and
        outputs with that leading size are concatenated.
        """
        captured = self.program.captured
        batch = batch_size_of(args, kwargs)
        if not captured.dynamic_batch and batch != captured.captured_batch_size:
            return self._call_in_chunks(args, kwargs, batch)
        flat = captured.flatten_inputs(args, kwargs)
        env = dict(zip(captured.input_names, flat))
        outputs: tuple = ()
        for stage in self.stages:
            ins = [_to(env[name], stage.device) for name in stage.inputs]
            outputs = tuple(stage.module(*ins))
            env.update(zip(stage.outputs, outputs))
        return captured.unflatten_outputs(list(outputs))

    def _call_in_chunks(self, args: tuple, kwargs: dict, batch: int) -> Any:
        size = self.program.captured.captured_batch_size
        if batch % size:
            raise ConfigError(
                f"this model was captured with static shapes for batch {size} "
                f"({'; '.join(self.program.captured.notes)}); call it with a multiple of {size}"
            )
        chunks = split_microbatches(args, kwargs, None, batch // size)
        results = [self(*c.args, **c.kwargs) for c in chunks]
        leaves = [pytree.tree_flatten(r) for r in results]
        merged = []
        for parts in zip(*[l for l, _ in leaves]):
            if isinstance(parts[0], torch.Tensor) and parts[0].dim() > 0 and parts[0].shape[0] == size:
                merged.append(torch.cat(parts))
            else:
                raise ConfigError(
                    "a statically captured model's output has no batch dimension to join chunks "
                    f"along; call it with the captured batch size {size}"
                )
        return pytree.tree_unflatten(merged, leaves[0][1])

    def step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step over `microbatches` micro-batches; returns the mean loss.

        Gradients start from zero and end as those of the mean micro-batch loss; with an
        optimizer, every stage's parameters are updated.
        """
        captured = self.program.captured
        mbs = split_microbatches(args, kwargs, target, self.microbatches)
        flat = [captured.flatten_inputs(mb.args, mb.kwargs) for mb in mbs]
        for p in self._all_parameters():
            p.grad = None
        for worker in self.workers:
            worker.peak_inflight = 0
        steps = self.executor.run(self.schedule, mbs, flat)
        last = self.workers[-1]
        losses = [last.losses.pop(mb.index) for mb in mbs]
        self._sum_tied_gradients()
        if self.optimizers and steps:
            for opt in self.optimizers:
                if opt is not None:
                    opt.step()
        return torch.stack([l.detach().to(losses[0].device) for l in losses]).mean()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameter names in the model's order (a tied parameter once)."""
        for name in self.program.captured.parameter_names:
            yield name, self.program.tensors[name][0][1]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Original keys, interchangeable with `model.state_dict()`."""
        keys = self.program.captured.state_keys
        return {k: self.program.tensors[k][0][1].detach() for k in keys}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy `state` into every copy of every tensor (tied copies on all their devices)."""
        keys = set(self.program.captured.state_keys)
        missing, unexpected = keys - set(state), set(state) - keys
        if strict and (missing or unexpected):
            raise ConfigError(
                f"load_state_dict: missing keys {sorted(missing)[:5]}, unexpected keys "
                f"{sorted(unexpected)[:5]}; pass strict=False to load a subset"
            )
        with torch.no_grad():
            for key in keys & set(state):
                for _, tensor in self.program.tensors[key]:
                    tensor.copy_(state[key])

    def timeline(self) -> Timeline:
        """Measured start/end of every action of the last step, in the simulator's format."""
        return Timeline(tuple(self.executor.records), self.schedule.num_devices)

    def peak_inflight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations were held at once in the last
        step (compare with `pipe.predicted.peak_inflight(stage)`)."""
        return tuple(w.peak_inflight for w in self.workers)

    def plot_timeline(self, path: str) -> str:
        """Draw the predicted and the last measured timeline as a Gantt chart (PNG or SVG)."""
        from .runtime.plot import plot_timelines

        timelines = {"predicted": self.predicted, "measured": self.timeline()}
        return plot_timelines({k: t for k, t in timelines.items() if t is not None and t.events},
                              path, title=f"{self.schedule.name}, {len(self.stages)} stages, "
                                          f"{self.microbatches} micro-batches")

    def write_chrome_trace(self, path: str) -> str:
        """Write the last measured timeline as Chrome trace JSON (open it in Perfetto)."""
        import json

        with open(path, "w") as f:
            json.dump(self.timeline().to_chrome_trace(), f)
        return path

    # -- inspection -----------------------------------------------------------------------

    def __repr__(self) -> str:
        return stage_table(self)

    def explain(self) -> str:
        """The passes the compiler ran, how long each took and what it produced."""
        return explain_passes(self.passes)

    # -- internals -------------------------------------------------------------------------

    def _all_parameters(self) -> list[torch.Tensor]:
        seen = {}
        for copies in self.program.tensors.values():
            for _, t in copies:
                if isinstance(t, torch.nn.Parameter):
                    seen[id(t)] = t
        return list(seen.values())

    def _sum_tied_gradients(self) -> None:
        """Copies of a tied parameter on different devices each get the sum of their grads."""
        for tie in self.program.ties:
            copies = {id(t): t for _, t in self.program.tensors[tie.names[0]]}
            if len(copies) < 2:
                continue  # one object shared by the stages: autograd already summed
            tensors = list(copies.values())
            grads = [t.grad for t in tensors if t.grad is not None]
            if not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                total += g.to(total.device)
            for t in tensors:
                t.grad = total.to(t.device)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


def _values_needing_grad(program: StagedProgram) -> set[str]:
    """Boundary values that are floating point (gradients flow back through them)."""
    values = program.captured.values
    return {
        name for name in program.producer
        if values[name].dtype is not None and values[name].dtype.is_floating_point
    }


def _build_optimizers(program: StagedProgram, optimizer: Callable | None) -> list:
    """One optimizer per stage over the parameters it owns (a shared object: its first stage)."""
    if optimizer is None:
        return []
    owned: set[int] = set()
    result = []
    for stage in program.stages:
        params = []
        for p in stage.module.parameters():
            if p.requires_grad and id(p) not in owned:
                owned.add(id(p))
                params.append(p)
        result.append(optimizer(params) if params else None)
    return result
