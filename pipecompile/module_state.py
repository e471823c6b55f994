"""The `Pipeline` as the model's `nn.Module`: the model's names over a plan's tensors.

    mirror_model(pipe, model)           before any plan (lazy): the model's own tensors
    adopt(pipe, plan, runtime, model)   register this process's copies of the plan's tensors
                                        under the model's names (mirror.py), with its hooks
    own_state(pipe)                     every (name, tensor) registered, tied names included
    check_runnable(pipe, plan, where)   the plan's devices are here, no tensor left on meta
    load_state(pipe, program, ...)      `load_state_dict` into every copy of every tensor
    to_empty / init_weights / load_weights
                                        a meta model's tensors given memory, then values
                                        (weights/materialize.py, weights/load.py), this
                                        process's only; what to_empty allocated is tracked
                                        (weights/unwritten.py) until check_runnable finds it written

A lazily compiled pipeline adopts each plan it switches to; every plan places the model's
tensors through one shared table, so the names keep pointing at the same objects.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from .weights.load import load_weights as load_checkpoint
from .deferred import check_same_tensors
from .errors import ConfigError
from .weights import materialize
from .weights.materialize import check_materialised, copy_to_ties
from .mirror import copy_state_dict_hooks, mirror
from .planner.options import require_present
from .ir.records import StagedProgram
from .planner.plan import Plan
from .runtime.assemble import Runtime
from .weights.shard_slices import as_pieces, blocks_of, pieces_after_optimizer_steps
from .weights.unwritten import Unwritten, refuse

__all__ = ["mirror_model", "adopt", "own_state", "check_runnable", "check_written", "load_state", "to_empty",
           "init_weights", "load_weights"]


def mirror_model(pipe: torch.nn.Module, model: torch.nn.Module) -> None:
    """Register `model`'s own tensors on `pipe` under their names, a tied one under each (a
    pipeline not planned yet)."""
    persistent = set(model.state_dict(keep_vars=True))
    mirror(pipe, ((n, t, n in persistent) for n, t in
                  [*model.named_parameters(remove_duplicate=False),
                   *model.named_buffers(remove_duplicate=False)]))


def adopt(pipe: torch.nn.Module, plan: Plan, runtime: Runtime, model: torch.nn.Module | None,
          *, keep: bool = False) -> None:
    """Register `runtime`'s copies of `plan`'s tensors on `pipe` under the model's names (the
    state-dict keys first, in the model's order), replacing what was registered before.
    `keep`: the parameters registered now must be those the plan trains (an optimizer built
    over them before the first plan would otherwise update tensors no stage uses)."""
    assert plan.program is not None, "a finished plan"
    captured = plan.program.captured
    persistent = set(captured.state_keys)
    names = [*captured.state_keys, *(n for n in plan.program.tensors if n not in persistent)]
    owned = [(n, runtime.own_copy(n)) for n in dict.fromkeys(names)]
    if keep:
        check_same_tensors(dict(torch.nn.Module.named_parameters(pipe)), dict(owned))
    for table in (pipe._modules, pipe._parameters, pipe._buffers):
        table.clear()
    pipe._non_persistent_buffers_set.clear()
    mirror(pipe, ((n, t, n in persistent) for n, t in owned if t is not None))
    if model is not None:
        copy_state_dict_hooks(pipe, model)
    if any(isinstance(t, DTensor) for _, t in owned) and not pipe.__dict__.get("_dcp_pieces"):
        pipe.__dict__["_dcp_pieces"] = True  # once: a lazy pipeline adopts every plan
        pipe.register_state_dict_post_hook(_dcp_pieces)
        if any(len(blocks) > 1 for _, t in owned
               if t is not None and (blocks := blocks_of(t)) is not None):
            pieces_after_optimizer_steps()  # a fused projection's moments: DCP pieces too


def _dcp_pieces(module: torch.nn.Module, state: dict[str, Any], prefix: str,
                local_metadata: Any) -> None:
    """A fused projection's DTensor (`_StridedShard`) in `state_dict()` shown to
    torch.distributed.checkpoint as its pieces (weights/shard_slices.py `as_pieces`), so DCP
    saves and loads it; the value stays the DTensor."""
    for value in state.values():
        if isinstance(value, DTensor):
            as_pieces(value)


def own_state(pipe: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer registered on `pipe`, a tied one under each of its names."""
    yield from torch.nn.Module.named_parameters(pipe, remove_duplicate=False)
    yield from pipe.named_buffers(remove_duplicate=False)


def check_runnable(pipe: torch.nn.Module, plan: Plan, where: str) -> None:
    """Raise a `ConfigError` naming the call `where` unless `plan`'s devices are present, none
    of `pipe`'s tensors is on meta (given no memory yet) and every tensor `to_empty` gave
    memory has been written since (loaded, initialised or recomputed)."""
    require_present(plan.resolved.devices, where=where)
    o = plan.resolved
    if o.data_parallel > 1 and o.ranks.topology is None:  # a loaded (or absent) layout
        raise ConfigError(
            f"{where}: this plan is for {o.data_parallel} data-parallel replicas of a "
            f"{len(o.devices)}-device pipeline, and this process has no torch.distributed group "
            f"of {o.data_parallel * len(o.devices)} ranks to run them (a loaded plan rebuilds "
            f"one replica's stages); compile under torchrun with data_parallel="
            f"{o.data_parallel}, or compile again without data parallelism to run here")
    check_written(pipe, plan, where)


def check_written(pipe: torch.nn.Module, plan: Plan, where: str) -> None:
    """Raise a `ConfigError` naming the call `where` if a tensor of `pipe` is on meta or was
    given memory by `to_empty` and not written since: what a step, `save` and `export_onnx`
    refuse to run on or to write out."""
    check_materialised(own_state(pipe), where)
    left = _unwritten(pipe).left()
    if left:
        raise refuse(left, set(plan.ready.program.captured.state_keys), where)


def _unwritten(pipe: torch.nn.Module) -> Unwritten:
    """What `to_empty` allocated on `pipe` and no check has found written yet."""
    found = pipe.__dict__.get("_unwritten")
    if found is None:
        found = pipe.__dict__["_unwritten"] = Unwritten()
    return found


def load_state(pipe: torch.nn.Module, program: StagedProgram, state_dict: Mapping[str, Any],
               *, strict: bool, assign: bool) -> _IncompatibleKeys:
    """Load `state_dict` (the model's keys) into every copy of every tensor: this process's,
    and a tied weight's copies on other devices. `strict` asks for the keys this process holds
    (under torch.distributed: its stages', as `set_state_dict` passes them) and accepts any of
    the model's keys."""
    keys = set(program.captured.checkpoint_keys)
    held = set(torch.nn.Module.state_dict(pipe, keep_vars=True))
    missing, unexpected = sorted(held - set(state_dict)), sorted(set(state_dict) - keys)
    if strict and (missing or unexpected):
        raise ConfigError(
            f"load_state_dict: missing keys {missing[:5]}, unexpected keys "
            f"{unexpected[:5]}; pass strict=False to load a subset")
    if assign:
        raise ConfigError("load_state_dict(assign=True) would replace the stages' tensors; "
                          "a Pipeline loads by copying (assign=False)")
    torch.nn.Module.load_state_dict(pipe, {k: v for k, v in state_dict.items() if k in keys},
                                    strict=False)
    copy_to_ties(program.tensors, dict(own_state(pipe)))
    return _IncompatibleKeys(missing, unexpected)


def to_empty(pipe: torch.nn.Module, program: StagedProgram, own_stages: Sequence[int], *,
             device: Any = None, model: torch.nn.Module | None = None) -> None:
    """Give `pipe`'s meta tensors memory on their stages' devices (poisoned: unwritten), then
    recompute the non-persistent buffers among them where `model`'s library gives a way
    (transformers); everything else waits for `load_weights`, `init_weights` or
    `load_state_dict`, and a step refuses to run before."""
    if device is not None:
        raise ConfigError("pipe.to_empty() allocates each stage's tensors on the device "
                          "compile placed it on; call it without device=")
    allocated = {id(t) for t in materialize.to_empty(
        program.tensors, {s: program.stages[s].device for s in own_stages})}
    own = dict(own_state(pipe))
    fresh = [(n, t) for n, t in own.items() if id(t) in allocated]
    _unwritten(pipe).add(fresh)
    persistent = set(program.captured.state_keys)
    buffers = [n for n, _ in fresh if n not in persistent]
    if model is not None and buffers:
        materialize.recompute_buffers(model, own, buffers)


def init_weights(pipe: torch.nn.Module, model: torch.nn.Module | None,
                 fn: Callable[[torch.nn.Module], None] | None) -> list[str]:
    """`fn(module)` (default: its `reset_parameters()`) for every module of `model` holding
    one of `pipe`'s parameters or one of its buffers still unwritten, seeded by (torch's seed,
    the module's name)."""
    if model is None:
        raise ConfigError("init_weights needs the model's modules; a pipeline rebuilt by "
                          "pipecompile.load has only its graphs: use load_weights(path)")
    check_materialised(own_state(pipe), "pipe.init_weights()")
    own = dict(own_state(pipe))
    params = {n for n, _ in torch.nn.Module.named_parameters(pipe, remove_duplicate=False)}
    buffers = set(_unwritten(pipe).left()) - params
    return materialize.init_weights(model, own, fn, buffers=buffers)


def load_weights(pipe: torch.nn.Module, program: StagedProgram, path: str | os.PathLike, *,
                 strict: bool = True, model: torch.nn.Module | None = None) -> _IncompatibleKeys:
    """`pipe`'s tensors read from `path` (only the files and tensors it holds), converted as
    `model`'s library loads them (transformers); strict: every key it holds must be there."""
    check_materialised(own_state(pipe), "pipe.load_weights()")
    return load_checkpoint(pipe, dict(own_state(pipe)), path, program.captured.checkpoint_keys,
                           [t.names for t in program.ties], strict=strict, model=model)
