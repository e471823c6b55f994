"""`compile`: the public entry. It builds the `Request` (planner/request.py: compile's options,
grouped and checked once) and hands it to the recipe (planner/recipe.py: the passes over one
frozen `Plan`), now or, without example inputs, at the pipeline's first call (deferred.py);
the `Pipeline` runs the plan. `pipe.explain()` shows the request, what the passes resolved of
it, and each pass's record.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch
from typing_extensions import Unpack

from .capture.capture import require_module
from .deferred import Planner
from .ir.records import Example
from .pipeline import Pipeline
from .planner.recipe import plan_for
from .planner.request import Options, Request

__all__ = ["compile"]


def compile(  # noqa: A001 - the public name of the design
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    example_target: Any = None,
    **options: Unpack[Options],
) -> Pipeline:
    """Compile `model` into a pipeline over `devices`.

    Without `example_inputs`/`example_kwargs` the pipeline plans lazily: its first
    `step(...)` or call captures and plans from those inputs, and a later call whose inputs the
    plan cannot run is planned again (see `deferred.py`). With them, it plans now.

    `devices` is a count (CUDA devices if present, else that many CPU workers; 1 when not
    given), a list of device names, or a list of `DeviceSpec` (relative speed, memory) for
    heterogeneous devices.
    `memory_limit` (bytes, per device or one for all) caps each stage's predicted memory.
    `example_target` (the target of the example batch) lets `profile=True` time `loss_fn` too.
    `rng="per-microbatch"` draws every random op from a stream of (`rng_seed`, step,
    micro-batch, op); `verbose=True` shows torch's output while capturing; `compile_stages`
    runs each stage graph through `torch.compile`. `symbolic_sizes="auto"` captures the batch
    symbolic, and a lazy pipeline's new plan for a size its plans fixed every size (torch.compile's
    automatic dynamic shapes); `"all"` every size of a batched input symbolic from the start
    (one plan for any sequence length); `"batch"` the batch alone, always. `capture_budget` is
    the seconds the attempt with every size symbolic may take (in a child process, killed then:
    capture keeps the batch alone symbolic and `explain()` says so).

    `schedule`, `microbatches`, `virtual_stages` and `checkpoint` default to "auto": the search
    pass costs every combination (synchronous schedules, micro-batch counts dividing the batch,
    recomputation only on the stages whose memory needs it) and keeps the fastest predicted
    plan that fits; a value given explicitly is kept as given. `pipe.explain()` shows the
    candidates. A hand-written `schedule` (a `Schedule`, its text or CSV, or a .csv/.txt path)
    fixes devices, virtual stages and micro-batches (which must agree); it is validated now.

    Under torch.distributed (an initialised process group, or torchrun's environment) the same
    call runs on every rank: `devices` is the number of pipeline ranks and `data_parallel` the
    number of pipeline replicas; each rank keeps only its own stages. `fsdp=True` shards each
    stage over the replicas (`fully_shard`); `mesh` is a ("dp", "pp") DeviceMesh to use. Each
    rank then passes its replica's batch. With `data_parallel="auto"`, or neither `devices`
    nor `data_parallel` given, the search chooses P x D = the ranks (and FSDP with
    `fsdp="auto"`; `devices=P` or a written schedule fixes P) by this machine's measured
    costs, and every rank passes the GLOBAL batch: replica r of D takes its rows
    [r B/D, (r+1) B/D), the loss returned is the global batch's. `tensor_parallel=T` splits
    each stage's column/row-parallel matmul pairs over T consecutive ranks (devices=P,
    data_parallel=D: P x D x T ranks under torchrun; every rank of a replica passes its
    batch); what cannot be split exactly stays replicated (explain() says why). Embeddings
    and the output layer are split along the vocabulary where the cost model prices it
    cheaper (the logits all-gathered before `loss_fn`), replicated otherwise;
    `vocab_parallel=True` or `False` decides it instead.
    `tensor_parallel="auto"` (devices and data_parallel left out) searches T with P x D, T
    dividing the ranks per node and the attention heads, and runs the chosen T as a given one.
    On `devices=pipecompile.cluster(...)` (planned, nothing runs) `sequence_parallel=True`
    prices each tensor-parallel group as also splitting the tokens of its norms, dropout and
    residuals (Korthikanti et al. 2022), "auto" lets the layout search try both. Under
    torchrun with a given T, `sequence_parallel=True` runs it: the tokens between each row and
    the next column split over the T ranks, pipeline messages whole ("auto" is False there).

    `cache` keeps what compiling measures or derives (this machine's rates, the planning probe,
    symbolic block costs), keyed by content: the process-wide `compile_cache.default_cache`
    unless another `CompileCache` is given (`.clear()` empties one); None caches nothing.
    """
    request = Request.of(**options)
    require_module(model)
    if not example_inputs and not example_kwargs:  # lazy: plans on the first call
        plan_for(None, request)  # check the options now, not at the first step
        return Pipeline(planner=Planner(model, lambda example: plan_for(example, request)))
    example = Example(model, tuple(example_inputs), dict(example_kwargs or {}), example_target)
    return Pipeline(plan_for(example, request), model=model)


def __getattr__(name: str) -> Any:
    if name == "PASSES":  # moved: the recipe lives in the planner
        warnings.warn("pipecompile.compiler.PASSES moved to pipecompile.planner.recipe.PASSES",
                      DeprecationWarning, stacklevel=2)
        from .planner.recipe import PASSES
        return PASSES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
