"""Pipeline: the compiled, runnable program returned by `pipecompile.compile`.

A `Pipeline` is an `nn.Module` with the original model's parameter and buffer names (see
`mirror.py`), holding this process's stage tensors. It keeps the frozen `Plan` the compiler
produced and the runtime assembled for it (`runtime/assemble.py`), and offers the user-facing
API: `pipe(*args)`, `pipe.step(*args, target=y)`, `fit`, `state_dict()`, `print(pipe)`,
`explain()`, `simulate()`, `timeline()`, `save`, `draw`, `export_onnx`.

    Plan (frozen: program, schedule, costs, pass records) ──▶ assemble() ──▶ Runtime
       │                                                                      │
       └────────────────────────────  Pipeline(nn.Module)  ◀──────────────────┘
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.nn.modules.module import _IncompatibleKeys

from .capture import batch_size_of
from .draw import draw_partition
from .deferred import Planner, cannot_run, check_same_tensors
from .errors import ConfigError
from .inputs import batch_parts, check_inputs
from .options import require_present
from .materialize import (check_materialised, copy_to_ties, init_weights as init_modules,
                          load_weights)
from .materialize import to_empty as allocate
from .mirror import copy_state_dict_hooks, mirror
from .passes.split import Stage, StagedProgram
from .persist import load_plan, save_plan
from .plan import PassRecord, Plan
from .report import explain_passes, explain_search, stage_table
from .schedule.actions import Schedule
from .runtime.assemble import Runtime, assemble
from .runtime.distributed import Topology
from .runtime.executor import Executor
from .memory_report import DeviceMemory, device_memory
from .runtime.microbatch import MicroBatch, forward_in_chunks, split_microbatches
from .schedule.schedules import make_schedule
from .schedule.simulate import StageCosts, Timeline, simulate
from .runtime.training import check_num_items, loss_scale_value

__all__ = ["Pipeline", "PassRecord", "load"]


class Pipeline(torch.nn.Module):
    """A model split into pipeline stages, trained by interpreting a schedule."""

    def __init__(self, plan: Plan | None = None, *, planner: Planner | None = None,
                 model: torch.nn.Module | None = None):
        super().__init__()
        assert (plan is None) != (planner is None), "a plan, or a planner for a lazy pipeline"
        self._plan: Plan | None = None
        self._runtime: Runtime | None = None
        self._planner = planner
        # the user's model (not a submodule: its tensors are registered by mirror), whose own
        # modules init_weights runs and whose state-dict hooks the mirror copies
        self._source = (planner.model if planner is not None else model,)
        self._materialised = False  # checked once: no meta tensor left in this process
        self._plans: list[tuple[Plan, Runtime]] = []  # lazy: every plan made so far
        self._read_unplanned = False  # lazy: parameters were read before the first plan
        if plan is not None:
            self._use(plan, assemble(_program(plan), _schedule(plan), plan.options))
        else:
            assert planner is not None
            model = planner.model
            persistent = set(model.state_dict(keep_vars=True))
            mirror(self, ((n, t, n in persistent) for n, t in
                          [*model.named_parameters(), *model.named_buffers()]))

    def _use(self, plan: Plan, runtime: Runtime) -> None:
        """Run `plan` from now on: its runtime, and the model's names over its tensors."""
        assert plan.program is not None and plan.schedule is not None, "an unfinished plan"
        if self._runtime is not None and runtime is not self._runtime:
            runtime.set_training(self.training)
        captured = plan.program.captured
        persistent = set(captured.state_keys)
        names = [*captured.state_keys, *(n for n in plan.program.tensors if n not in persistent)]
        owned = [(n, runtime.own_copy(n)) for n in dict.fromkeys(names)]
        if self._plan is None and self._read_unplanned:
            check_same_tensors(dict(self.named_parameters()), dict(owned))
        self._plan, self._runtime = plan, runtime
        for table in (self._modules, self._parameters, self._buffers):
            table.clear()
        self._non_persistent_buffers_set.clear()
        mirror(self, ((n, t, n in persistent) for n, t in owned if t is not None))
        if self._source[0] is not None:
            copy_state_dict_hooks(self, self._source[0])
        self._materialised = False

    def _ready(self, args: tuple, kwargs: Mapping[str, Any], target: Any, *, where: str,
               microbatched: bool = True) -> None:
        """Check a call's inputs; a lazy pipeline first finds or makes a plan that runs them."""
        if self._planner is None:
            check_inputs(self.program.captured, args, kwargs, where=where)
            self._check_materialised(where)
            return
        reasons = []
        for plan, runtime in self._plans:
            reason = cannot_run(plan, args, kwargs, where=where, microbatched=microbatched)
            if reason is None:
                if plan is not self._plan:
                    self._use(plan, runtime)
                self._check_materialised(where)
                return
            reasons.append(reason)
        if self._plans:
            self._check_can_replan(reasons[-1])
        plan = self._planner.plan(args, kwargs, target, where=where)
        runtime = assemble(_program(plan), _schedule(plan), plan.options)
        self._plans.append((plan, runtime))
        self._use(plan, runtime)
        check_inputs(self.program.captured, args, kwargs, where=where)
        self._check_materialised(where)

    def _check_materialised(self, where: str) -> None:
        """Once per plan: its devices are here and no meta tensor is left in this process."""
        if not self._materialised:
            require_present(self.plan.options.devices, where=where)
            check_materialised(self._own_state(), where)
            self._materialised = True

    def _own_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from super().named_parameters(remove_duplicate=False)
        yield from self.named_buffers(remove_duplicate=False)

    def _check_can_replan(self, reason: str) -> None:
        options = self.plan.options
        if options.ranks.distributed:
            raise ConfigError(
                f"these inputs need a new plan ({reason}), but under torch.distributed every "
                f"rank would have to re-plan at the same step; pass inputs the first plan runs "
                f"(any size capture kept symbolic may vary)")
        if options.optimizer is not None:
            raise ConfigError(
                f"these inputs need a new plan ({reason}), whose stages would get new "
                f"optimizers from optimizer=...; pass inputs the first plan runs, or use your "
                f"own optimizer over pipe.parameters(), which every plan shares")

    # -- the lazy pipeline's state ---------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan this pipeline runs (a lazy pipeline's latest, once it has one)."""
        if self._plan is None:
            raise ConfigError(_NOT_PLANNED)
        return self._plan

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise ConfigError(_NOT_PLANNED)
        return self._runtime

    @property
    def planned(self) -> bool:
        """False for a lazily compiled pipeline until its first call."""
        return self._plan is not None

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if self._plan is None:
            self._read_unplanned = True  # an optimizer may be built over them: see _use
        return super().named_parameters(prefix, recurse, remove_duplicate)

    # -- what was compiled ----------------------------------------------------------------

    @property
    def program(self) -> StagedProgram:
        return _program(self.plan)

    @property
    def schedule(self) -> Schedule:
        return _schedule(self.plan)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.program.stages

    @property
    def microbatches(self) -> int:
        return self.plan.options.microbatches

    @property
    def predicted(self) -> Timeline | None:
        return self.plan.predicted

    @property
    def stage_costs(self) -> tuple[StageCosts, ...]:
        return self.plan.stage_costs

    @property
    def cores(self) -> int | None:
        return self.plan.cores

    @property
    def efficiency(self) -> float:
        return self.plan.efficiency

    @property
    def passes(self) -> tuple[PassRecord, ...]:
        return self.plan.passes

    # -- what runs it -----------------------------------------------------------------------

    @property
    def topology(self) -> Topology | None:
        """This rank's place under torch.distributed; None in a single process."""
        return self.plan.options.ranks.topology

    @property
    def executor(self) -> Executor:
        return self.runtime.executor

    @property
    def own_stages(self) -> tuple[int, ...]:
        return self.runtime.own_stages

    @property
    def last_schedule(self) -> Schedule:
        return self.runtime.last_schedule

    @property
    def communication(self) -> Any:
        """The last step's message statistics (point-to-point transport), else None."""
        return self.runtime.communication

    # -- the model's API ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, stage after stage on the whole batch: returns what the model returns.

        A model captured with static shapes runs in chunks of its captured batch size, and
        outputs with that leading size are concatenated.
        """
        self._ready(args, kwargs, None, where="pipe()", microbatched=False)
        captured = self.program.captured
        batch = batch_size_of(args, kwargs)
        if not captured.dynamic_batch and batch != captured.captured_batch_size:
            return forward_in_chunks(self.runtime.forward, captured, args, kwargs, batch)
        return self.runtime.forward(args, kwargs)

    def step(self, *args: Any, target: Any = None, loss_scale: Any = None,
             num_items_in_batch: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step over `microbatches` micro-batches; returns the mean loss.

        Synchronous schedules: gradients start from zero and end as those of the mean
        micro-batch loss; with an optimizer, every stage's parameters are updated. PipeDream
        and 2BW update during the step (see `runtime/versions.py`) and drain at its end.
        A `torch.autocast` active around the call applies in every stage. `loss_scale` (a
        number or a `torch.amp.GradScaler`) multiplies the loss before backward, so the
        gradients are that many times larger; the returned loss is not scaled.

        `num_items_in_batch=N` (the transformers Trainer's global-token normalisation): each
        micro-batch's loss is `loss_fn(out, target, num_items_in_batch=N)` and the step's loss
        is their sum over micro-batches and replicas, as are the gradients: the unsplit
        model's loss over the N items of the global batch, however padding falls.
        """
        self._ready(args, kwargs, target, where="pipe.step()")
        if num_items_in_batch is not None:
            check_num_items(self.plan.options.loss_fn, num_items_in_batch)
        mbs = split_microbatches(args, kwargs, target, self.microbatches)
        scale = loss_scale_value(loss_scale, self.runtime.wiring.devices[-1])
        return self.runtime.run(self.schedule, mbs, batches=1, loss_scale=scale,
                                num_items=num_items_in_batch)[0]

    def eval_step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """The validation loss of a batch: the mean over micro-batches of
        `loss_fn(model.eval()(x_i), y_i)`, by forwards only in eval mode without autograd.
        Gradients, parameters and `pipe.training` are left as they were."""
        self._ready(args, kwargs, target, where="pipe.eval_step()")
        mbs = split_microbatches(args, kwargs, target, self.microbatches)
        return self.runtime.evaluate(mbs)

    def train(self, mode: bool = True) -> "Pipeline":
        """Train mode (the default) or, with `mode=False` (`pipe.eval()`), eval mode: the
        stages run their inference graphs (batch norm reads its running statistics, dropout
        is off), as `model.eval()` does to the unsplit model."""
        super().train(mode)
        if self._runtime is not None:
            self._runtime.set_training(mode)
        return self

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their global norm, as `torch.nn.utils.clip_grad_norm_`
        over `model.parameters()` would: the norm covers every stage, on every rank, a tied
        parameter once; returns that total norm (the same on every rank)."""
        if self.runtime.asynchronous:
            raise ConfigError(
                f"schedule={self.schedule.name!r} updates the weights during the step, so there "
                f"are no step gradients to clip afterwards; use a synchronous schedule")
        return self.runtime.clip_grad_norm(max_norm, norm_type, error_if_nonfinite)

    def fit(self, batches: Iterable[tuple]) -> list[torch.Tensor]:
        """Train on a stream of batches; returns each batch's mean loss.

        Each batch is `(args, target)` or `(args, kwargs, target)`, `args` a tuple of positional
        inputs. PipeDream and 2BW run the whole stream as one schedule, without draining the
        pipeline between batches; synchronous schedules flush after every batch (a `step` each).
        """
        batches = [batch_parts(b) for b in batches]
        if batches:
            self._ready(*batches[0], where="pipe.fit()")
        if not self.runtime.asynchronous:
            return [self.step(*a, target=t, **k) for a, k, t in batches]
        mbs: list[MicroBatch] = []
        for a, k, t in batches:
            check_inputs(self.program.captured, a, k, where="pipe.fit()")
            for mb in split_microbatches(a, k, t, self.microbatches):
                mbs.append(replace(mb, index=len(mbs)))
        schedule = make_schedule(self.schedule.name, self.schedule.num_devices,
                                 self.microbatches, batches=len(batches),
                                 dataflow=self.runtime.wiring.dataflow())
        return self.runtime.run(schedule, mbs, batches=len(batches))

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Load `state_dict` (the model's keys) into every copy of every tensor: this
        process's, and a tied weight's copies on other devices. `strict` asks for the keys
        this process holds (under torch.distributed: its stages', as `set_state_dict` passes
        them) and accepts any of the model's keys."""
        keys = set(self.program.captured.checkpoint_keys)
        held = set(super().state_dict(keep_vars=True))
        missing, unexpected = sorted(held - set(state_dict)), sorted(set(state_dict) - keys)
        if strict and (missing or unexpected):
            raise ConfigError(
                f"load_state_dict: missing keys {missing[:5]}, unexpected keys "
                f"{unexpected[:5]}; pass strict=False to load a subset")
        if assign:
            raise ConfigError("load_state_dict(assign=True) would replace the stages' tensors; "
                              "a Pipeline loads by copying (assign=False)")
        super().load_state_dict({k: v for k, v in state_dict.items() if k in keys}, strict=False)
        copy_to_ties(self.program.tensors, dict(self._own_state()))
        return _IncompatibleKeys(missing, unexpected)

    # -- models bigger than one process (materialize.py) ---------------------------------

    def to_empty(self, *, device: Any = None, recurse: bool = True) -> "Pipeline":
        """Give this process's meta tensors memory on their stages' devices (uninitialised);
        tensors already real keep their values. Then `load_weights` or `init_weights`."""
        if device is not None:
            raise ConfigError("pipe.to_empty() allocates each stage's tensors on the device "
                              "compile placed it on; call it without device=")
        allocate(self.program.tensors, {s: self.stages[s].device for s in self.own_stages})
        self._materialised = False
        return self

    def init_weights(self, fn: Callable[[torch.nn.Module], None] | None = None) -> list[str]:
        """Initialise this process's tensors: `fn(module)` (default: the module's own
        `reset_parameters()`) for every submodule of the model holding one of them, seeded by
        (torch's seed, the module's name), so any stage count gives the same weights.
        Returns the names of the modules initialised."""
        if self._source[0] is None:
            raise ConfigError("init_weights needs the model's modules; a pipeline rebuilt by "
                              "pipecompile.load has only its graphs: use load_weights(path)")
        check_materialised(self._own_state(), "pipe.init_weights()")
        return init_modules(self._source[0], dict(self._own_state()), fn)

    def load_weights(self, path: str | os.PathLike) -> _IncompatibleKeys:
        """Load this process's tensors from `path`: one .safetensors file, a directory of
        transformers shards (model.safetensors.index.json) or a torch.distributed.checkpoint
        directory, reading only the files and tensors this process holds. Keys are the
        model's state_dict keys; returns the missing and unexpected keys."""
        check_materialised(self._own_state(), "pipe.load_weights()")
        return load_weights(self, path, self.program.captured.checkpoint_keys,
                            [t.names for t in self.program.ties])

    def weight_versions(self) -> dict[int, int]:
        """Asynchronous schedules: per stage, the most weight versions held at once so far."""
        return {i: w.versions.peak_versions for i, w in self.runtime.workers.items()
                if w.versions is not None}

    def _apply(self, fn: Callable, recurse: bool = True) -> "Pipeline":
        raise ConfigError("a Pipeline's tensors stay on the devices compile placed them on; "
                          "pass devices=... to pipecompile.compile or pipecompile.load instead "
                          "of .to()/.cuda()/.double()")

    # -- timelines -------------------------------------------------------------------------

    def timeline(self) -> Timeline:
        """Measured start/end of every action of the last step, in the simulator's format."""
        return Timeline(tuple(self.runtime.executor.records), self.schedule.num_devices)

    def simulate(self, schedule: Schedule | None = None) -> Timeline:
        """Predicted timeline of `schedule` (default: the last one run, else the step's)."""
        return simulate(schedule or self.runtime.last_schedule, self.stage_costs,
                        cores=self.cores, efficiency=self.efficiency,
                        transfers=self.plan.transfers, overhead=self.plan.overhead)

    def peak_inflight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations were held at once in the last
        step (compare with `pipe.predicted.peak_inflight(stage)`)."""
        return tuple(w.peak_inflight for _, w in sorted(self.runtime.workers.items()))

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None
                     ) -> tuple[DeviceMemory, ...]:
        """Per device of this process, the memory of the last training step (parameters,
        gradients, optimizer state, the peak of saved activations; on CUDA the allocator's
        peak as the total) next to the plan's prediction; `print` one for a table. The
        optimizer state is the `optimizer=` one compile built, or `optimizer`'s (your own).
        Nothing to switch on: every step counts its saved tensors (about 2 us each, a byte
        span per tensor, see `runtime/memory.py`; the report is `memory_report.py`), so this always
        describes the last step."""
        optimizers = [optimizer] if optimizer is not None else self.runtime.optimizers
        return device_memory(self.runtime, self.plan, optimizers)

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

    # -- inspection, export and persistence ------------------------------------------------

    def __repr__(self) -> str:
        if self._plan is None:
            return f"Pipeline({type(self._planner.model).__name__ if self._planner else ''}: " \
                   f"{_NOT_PLANNED})"
        return stage_table(self.program, self.schedule, microbatches=self.microbatches,
                           predicted=self.predicted, specs=self.plan.stage_specs)

    def explain(self) -> str:
        """The passes the compiler ran, how long each took and what it produced; the plan the
        search chose and its best candidates."""
        return explain_passes(self.passes) + "\n\n" + explain_search(self.plan.search)

    def export_onnx(self, directory: str) -> str:
        """Write one ONNX file per stage (eval mode) and manifest.json; returns its path."""
        from .export import export_onnx

        check_materialised(self._own_state(), "pipe.export_onnx()")
        return export_onnx(self.program, directory)

    def save(self, directory: str | os.PathLike) -> str:
        """Write the plan (code, weights, schedule, costs, pass log); returns plan.json's path.
        `pipecompile.load(directory)` rebuilds the pipeline without the model's code."""
        check_materialised(self._own_state(), "pipe.save()")
        return save_plan(self.plan, directory)

    def draw(self, path: str, *, backend: str = "auto") -> str:
        """Draw the partition (blocks coloured by stage, cuts with their boundary sizes) as
        SVG or PNG by the extension of `path`; graphviz's `dot` if present, else matplotlib."""
        return draw_partition(self.program, path, microbatches=self.microbatches,
                              backend=backend)


def load(directory: str | os.PathLike, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
         devices: Sequence[str | torch.device] | None = None,
         compile_stages: bool | None = None) -> Pipeline:
    """Rebuild the Pipeline saved in `directory` (or from its plan.json path) by `pipe.save`.

    `devices` overrides the saved placement: one device per schedule device (a count of
    `pipe.schedule.num_devices`), e.g. `["cpu"] * 4` to run a CUDA-saved pipeline on the CPU.
    `compile_stages` overrides the saved setting (e.g. False on a machine without a C++
    compiler for inductor).
    """
    return Pipeline(load_plan(directory, loss_fn=loss_fn, optimizer=optimizer, devices=devices,
                              compile_stages=compile_stages))


_NOT_PLANNED = ("not planned yet: compiled without example inputs, it captures and plans on "
                "its first pipe.step(...) or pipe(...) call")


def _program(plan: Plan) -> StagedProgram:
    assert plan.program is not None, "a finished plan has its program"
    return plan.program


def _schedule(plan: Plan) -> Schedule:
    assert plan.schedule is not None, "a finished plan has its schedule"
    return plan.schedule
