"""Pipeline: the compiled, runnable program returned by `pipecompile.compile`.

An `nn.Module` with the model's parameter and buffer names over this process's stage tensors
(`module_state.py`). Each call runs on the plan `lazy.Plans` chooses for it; the last step's
`StepResult` is kept. The API: `pipe(*args)`, `pipe.step(*args, target=y)`, `fit`,
`state_dict()`, `print(pipe)`, `explain()`, `simulate()`, `timeline()`, `save`, `draw`.

    Plan (frozen) ──▶ assemble_plan() ──▶ Runtime ──run()──▶ StepResult
       │              (lazy.Plans: one plan, or one per call shape)      │
       └───────────────────  Pipeline(nn.Module)  ◀──────────────────────┘
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch.nn.modules.module import _IncompatibleKeys

from .deferred import Planner
from .errors import ConfigError
from .capture.inputs import batch_parts, check_inputs
from .lazy import NOT_PLANNED, Plans
from .outputs.memory_report import DeviceMemory, device_memory
from .outputs.metrics import InputSizes, pipeline_metrics
from .outputs.trace import write_job_trace
from . import module_state
from .ir.records import Stage, StagedProgram
from .outputs.persist import load_plan, save_plan
from .pipeline_compat import DeprecatedNames, is_model_name, model_attribute
from .planner.plan import PassRecord, Plan
from .planner.layout import Layout
from .outputs import presentation
from .runtime.assemble import Runtime
from .runtime.data_parallel import replica_microbatches
from .runtime.direct_forward import direct_forward, plain_call
from .runtime.distributed import Topology
from .runtime.microbatch import MicroBatch, split_microbatches
from .runtime.spec import StepResult
from .runtime.training import check_num_items, loss_scale_value
from .schedule.actions import Schedule
from .schedule.simulate import Timeline
from .planner.stage_costs import predict

__all__ = ["Pipeline", "PassRecord", "load"]


class Pipeline(DeprecatedNames, torch.nn.Module):
    """A model split into pipeline stages, trained by running the schedule's generated code."""

    def __init__(self, plan: Plan | None = None, *, planner: Planner | None = None,
                 model: torch.nn.Module | None = None):
        super().__init__()
        self._plans = Plans(plan=plan, planner=planner)
        self._plan: Plan | None = None
        self._runtime: Runtime | None = None
        self._last: StepResult | None = None  # what the last training step produced
        self._sizes: InputSizes | None = None  # its rows and tokens (`metrics()`)
        # the user's model, not a submodule: init_weights runs its modules, adopt copies hooks
        self._source = (planner.model if planner is not None else model,)
        self._materialised = False  # checked once per plan: no meta tensor left here
        self._read_unplanned = False  # lazy: parameters were read before the first plan
        if planner is not None:
            module_state.mirror_model(self, planner.model)
        else:
            self._use(*self._plans.kept[0])

    def _ready(self, args: tuple, kwargs: Mapping[str, Any], target: Any, *, where: str,
               microbatched: bool = True) -> None:
        """Check a call's inputs and switch to the plan that runs them (lazy: planning it)."""
        plan, runtime = self._plans.choose(args, kwargs, target, where=where,
                                           microbatched=microbatched)
        if plan is not self._plan:
            self._use(plan, runtime)
        if not self._materialised:  # once per plan: its devices are here, no meta tensor
            module_state.check_runnable(self, plan, where)
            self._materialised = True

    def _use(self, plan: Plan, runtime: Runtime) -> None:
        """Run `plan` from now on: its runtime, and the model's names over its tensors."""
        if self._runtime is not None:
            runtime.set_training(self.training)
        # parameters read before the first plan may be in an optimizer: they must stay
        module_state.adopt(self, plan, runtime, self._source[0],
                           keep=self._plan is None and self._read_unplanned)
        self._plan, self._runtime, self._materialised = plan, runtime, False

    # -- what was compiled, and what runs it ---------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan this pipeline runs (a lazy pipeline's latest, once it has one)."""
        if self._plan is None:
            raise ConfigError(NOT_PLANNED)
        return self._plan

    @property
    def runtime(self) -> Runtime:
        """The workers, executor and optimizers running the plan in this process."""
        if self._runtime is None:
            raise ConfigError(NOT_PLANNED)
        return self._runtime

    @property
    def planned(self) -> bool:
        """False for a lazily compiled pipeline until its first call."""
        return self._plan is not None

    @property
    def program(self) -> StagedProgram:
        """The stages: one GraphModule each, with its inputs, outputs and device."""
        return self.plan.ready.program

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage of the program (those of other ranks too): `.module` (its
        `fx.GraphModule`, the graph training runs), `.blocks`, `.parameter_names` (original
        names), `.device`, `.inputs`, `.outputs` and `.cost` (FLOPs, memory, times). A model
        with its own `stages` attribute keeps it: then read `pipe.program.stages`."""
        own = model_attribute(self, "stages")
        return own if is_model_name(own) else self.program.stages

    @property
    def schedule(self) -> Schedule:
        """The schedule a step runs (lowered: with its SEND/RECV actions)."""
        return self.plan.ready.schedule

    @property
    def predicted(self) -> Timeline | None:
        """The simulator's timeline of one step, as planned."""
        return self.plan.predicted

    @property
    def topology(self) -> Topology | None:
        """This rank's place under torch.distributed; None in a single process."""
        return self.plan.resolved.ranks.topology

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        if self._plan is None:
            self._read_unplanned = True  # an optimizer may be built over them: see _use
        return super().named_parameters(prefix, recurse, remove_duplicate)

    # -- the model's API ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward only, stage after stage on the whole batch: returns what the model returns."""
        self._ready(args, kwargs, None, where="pipe()", microbatched=False)
        return self.runtime.call(args, kwargs)

    def step(self, *args: Any, target: Any = None, loss_scale: Any = None,
             num_items_in_batch: Any = None, **kwargs: Any) -> torch.Tensor:
        """One training step over the plan's micro-batches; returns the mean loss.

        Synchronous schedules: gradients start from zero and end as those of the mean
        micro-batch loss, then compile's `optimizer=` (if any) steps; PipeDream and 2BW update
        during the step (`runtime/versions.py`). The caller's `torch.autocast` applies in every
        stage; `loss_scale` (a number or a `GradScaler`) scales the loss before backward, not
        the loss returned. `num_items_in_batch=N` (transformers' normalisation): losses and
        gradients summed over micro-batches and replicas, the unsplit model's over N items.
        With `data_parallel="auto"` every rank passes the global batch and its replica takes
        its rows; the loss is the global batch's (`runtime.data_parallel.replica_microbatches`)."""
        self._ready(args, kwargs, target, where="pipe.step()")
        if num_items_in_batch is not None:
            check_num_items(self.plan.asked.loss_fn, num_items_in_batch)
        mbs = self._microbatches(args, kwargs, target)
        scale = loss_scale_value(loss_scale, self.runtime.wiring.devices[-1])
        self._last = self.runtime.run(self.schedule, mbs, batches=1, loss_scale=scale,
                                      num_items=num_items_in_batch)
        self._sizes = InputSizes.of(mbs)
        return self._last.losses[0]

    def eval_step(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        """The validation loss of a batch, by forwards only in eval mode without autograd;
        gradients, parameters and `pipe.training` are left as they were."""
        self._ready(args, kwargs, target, where="pipe.eval_step()")
        return self.runtime.evaluate(self._microbatches(args, kwargs, target)).losses[0]

    def _microbatches(self, args: tuple, kwargs: Mapping[str, Any], target: Any) -> list:
        """This process's micro-batches of a step's batch: of its replica's rows when every
        rank passes the global batch (data_parallel="auto" under torch.distributed)."""
        o = self.plan.resolved
        topology = o.ranks.topology
        if self.plan.asked.global_batch and topology is not None and topology.data_parallel > 1:
            return replica_microbatches(args, kwargs, target, microbatches=o.microbatches,
                                        replica=topology.replica,
                                        replicas=topology.data_parallel)
        return split_microbatches(args, kwargs, target, o.microbatches)

    def fit(self, batches: Iterable[tuple]) -> list[torch.Tensor]:
        """Train on `(args, target)` or `(args, kwargs, target)` batches; each one's mean loss.
        PipeDream and 2BW run them as one schedule; synchronous schedules `step` each."""
        batches = [batch_parts(b) for b in batches]
        if batches:
            self._ready(*batches[0], where="pipe.fit()")
        if not self.runtime.asynchronous:
            return [self.step(*a, target=t, **k) for a, k, t in batches]
        for a, k, _ in batches:
            check_inputs(self.program.captured, a, k, where="pipe.fit()")
        self._last = self.runtime.run_stream(batches)
        self._sizes = InputSizes.of([MicroBatch(i, a, k, t, 0)
                                     for i, (a, k, t) in enumerate(batches)])
        return list(self._last.losses)

    def train(self, mode: bool = True) -> "Pipeline":
        """Train mode, or eval mode (`pipe.eval()`): the stages run their inference graphs."""
        super().train(mode)
        if self._runtime is not None:
            self._runtime.set_training(mode)
        return self

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the gradients by their global norm (every stage, every rank, a tied parameter
        once), as `torch.nn.utils.clip_grad_norm_(model.parameters())`; returns that norm."""
        return self.runtime.clip_grad_norm(max_norm, norm_type, error_if_nonfinite)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Load `state_dict` (the model's keys) into every copy of every tensor, a tied
        weight's copies on other devices too (`module_state.load_state`)."""
        return module_state.load_state(self, self.program, state_dict, strict=strict,
                                       assign=assign)

    def _apply(self, fn: Callable, recurse: bool = True) -> "Pipeline":
        raise ConfigError("a Pipeline's tensors stay on the devices compile placed them on; "
                          "pass devices=... to pipecompile.compile or pipecompile.load instead "
                          "of .to()/.cuda()/.double()")

    # -- models bigger than one process (materialize.py) ---------------------------------

    def to_empty(self, *, device: Any = None, recurse: bool = True) -> "Pipeline":
        """Give this process's meta tensors memory on their stages' devices; tensors already
        real keep their values, non-persistent buffers are recomputed where the model's
        library gives a way (transformers). Then `load_weights` or `init_weights`: a step
        refuses to run on a tensor nothing has written."""
        module_state.to_empty(self, self.program, self.runtime.own_stages, device=device,
                              model=self._source[0])
        self._materialised = False
        return self

    def init_weights(self, fn: Callable[[torch.nn.Module], None] | None = None) -> list[str]:
        """Initialise this process's tensors: `fn(module)` (default: `reset_parameters()`) for
        every module of the model holding one, seeded by (torch's seed, the module's name), so
        any stage count gives the same weights. Returns the names of the modules initialised."""
        return module_state.init_weights(self, self._source[0], fn)

    def load_weights(self, path: str | os.PathLike, *, strict: bool = True) -> _IncompatibleKeys:
        """Load this process's tensors (only) from a .safetensors file, transformers shards or a
        torch.distributed.checkpoint directory, a transformers model's keys converted as
        `from_pretrained` converts them; returns the missing and unexpected keys. `strict`: a
        key this process holds that the checkpoint lacks is a `CheckpointError`."""
        return module_state.load_weights(self, self.program, path, strict=strict,
                                         model=self._source[0])

    # -- the last step ---------------------------------------------------------------------

    @property
    def last_step(self) -> StepResult:
        """What the last training step produced (before any: an empty result)."""
        return self._last or StepResult((), self.schedule)

    @property
    def communication(self) -> Any:
        """The last step's message statistics (point-to-point transport), else None."""
        return self.last_step.communication

    def runtime_code(self, device: int = 0) -> str:
        """The generated Python that runs device `device`'s part of a training step."""
        return self.runtime.executor.code(self.schedule, device)

    def stage_code(self, stage: int) -> str:
        """The Python a training forward of `stage` runs: its graph emitted with direct calls
        (`runtime/direct_forward.py`: the graph's ops in the graph's order; under a split
        backward, of the graph with deferred linears), or the module's own code where the stage
        is called as a module (a weight version, hooks, a compiled stage)."""
        workers = self._runtime.workers if self._runtime is not None else {}
        if stage in workers:  # this process runs it: what its chosen behaviours run
            return workers[stage].forward_code()
        module = self.program.stages[stage].module
        direct = direct_forward(module, f"stage {stage}") if plain_call(module) else None
        if direct is not None:
            return direct.source
        return module.code if isinstance(module, torch.fx.GraphModule) else repr(module)

    def timeline(self) -> Timeline:
        """Measured start/end of every action of the last step, in the simulator's format."""
        return self.last_step.timeline

    def simulate(self, schedule: Schedule | None = None) -> Timeline:
        """Predicted timeline of `schedule` (default: the last one run, else the step's)."""
        return predict(schedule or self.last_step.schedule, self.plan)

    def metrics(self) -> dict[str, float]:
        """The last training step as a flat dict of floats for a logger (loss, step_time_s,
        bubble_fraction, samples_per_s, tokens_per_s, bytes_sent, peak_memory_bytes/device{d}:
        `outputs.metrics`); under torchrun every rank calls it and gets the job's values."""
        return pipeline_metrics(self, self._sizes)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None
                     ) -> tuple[DeviceMemory, ...]:
        """Per device of this process, the last training step's memory (parameters, gradients,
        `optimizer`'s or compile's optimizer state, saved activations' peak) and prediction."""
        optimizers = [optimizer] if optimizer is not None else self.runtime.optimizers
        return device_memory(self.runtime, self.plan, optimizers)

    def plot_timeline(self, path: str) -> str:
        """Draw the predicted and the last measured timeline as a Gantt chart (PNG or SVG)."""
        return presentation.plot_timeline(self.plan, self.timeline(), path)

    def write_chrome_trace(self, path: str) -> str:
        """Write the last step's actions as one Chrome trace for the job (open it in Perfetto):
        every device, arrows from sends to receives (`outputs.trace`). Under torchrun every
        rank calls it and rank 0 writes every rank's actions on one clock."""
        topology = self.topology
        return write_job_trace(self.last_step, path, distributed=topology is not None
                               and torch.distributed.is_initialized(),
                               pipeline_size=topology.pipeline_size if topology else None)

    # -- inspection, export and persistence ------------------------------------------------

    def __repr__(self) -> str:
        if self._plan is None:
            return f"Pipeline({type(self._source[0]).__name__}: {NOT_PLANNED})"
        return presentation.describe(self._plan)

    @property
    def layout(self) -> "Layout":
        """P pipeline positions x D replicas, FSDP or replicated, which dimension a node
        holds, and this process's position and replica (chosen with data_parallel="auto")."""
        return presentation.layout(self.plan)

    def explain(self) -> str:
        """The compiler's passes (time, result) and the search's best candidates."""
        return presentation.explain(self.plan)

    def draw(self, path: str, *, backend: str = "auto") -> str:
        """Draw the partition as SVG or PNG by the extension of `path`."""
        return presentation.draw(self.plan, path, backend=backend)

    def export_onnx(self, directory: str) -> str:
        """Write one ONNX file per stage (eval mode) and manifest.json; returns its path."""
        from .outputs.onnx_export import export_onnx

        module_state.check_written(self, self.plan, "pipe.export_onnx()")
        return export_onnx(self.program, directory)

    def save(self, directory: str | os.PathLike) -> str:
        """Write the plan (code, weights, schedule, costs, pass log) for `pipecompile.load`.
        With tensor_parallel=T every rank calls it with the same directory (collective: the
        whole weights are gathered); `pipecompile.load` under the same ranks shards it again."""
        module_state.check_written(self, self.plan, "pipe.save()")
        return save_plan(self.plan, directory)


def load(directory: str | os.PathLike, *, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
         optimizer: Callable[[list], torch.optim.Optimizer] | None = None,
         devices: Sequence[str | torch.device] | None = None,
         compile_stages: bool | None = None, trust_code: bool = False) -> Pipeline:
    """Rebuild the Pipeline `pipe.save` wrote to `directory` (or its plan.json path).
    `devices` overrides the saved placement (one per schedule device, e.g. `["cpu"] * 4` for a
    CUDA-saved pipeline), `compile_stages` the saved setting (False without a C++ compiler).
    Loading runs no code from the directory: each stage file must hold only what torch.fx
    writes (else a `StageCodeError` names the file and line); `trust_code=True` runs the files
    as Python, for directories you trust."""
    return Pipeline(load_plan(directory, loss_fn=loss_fn, optimizer=optimizer, devices=devices,
                              compile_stages=compile_stages, trust_code=trust_code))

