"""Materialise a model compiled on the meta device: memory for this process's stages only.

A model built under `torch.device("meta")` is captured, costed, partitioned and split without a
byte of weights (fake tensors carry the shapes). Its stages then hold meta tensors. A process
gives real memory to the tensors of *its* stages and nothing else:

    to_empty(program, own)   each meta tensor of an own stage gets memory on its stage's
                             device, in place (`torch.utils.swap_tensors`): the object stays the
                             same, so ties, the Pipeline's names and optimizers built over
                             pipe.parameters() keep pointing at it. The memory is poisoned
                             (unwritten.py), so what nothing writes later is found. Tensors
                             already real (a RoPE table built eagerly) keep their values,
                             unlike `nn.Module.to_empty`, which re-allocates every tensor.
    recompute_buffers(...)   non-persistent buffers (in no checkpoint) recomputed the way their
                             library does it after a meta build: transformers' `_init_weights`
    init_weights(...)        fn(module) for every original submodule holding an own tensor,
                             under a generator seeded by (torch's seed, the module's qualified
                             name): the same weights on 1, 2 or 4 stages, with any schedule.

Megatron and torchtitan seed initialisation per pipeline rank, so their weights change with the
layout; DeepSpeed seeds per layer index. Seeding by name is what makes a meta model's weights a
function of the model alone. Loading a checkpoint is load.py.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import sys
import weakref
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, TypeVar

import torch
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import ConfigError
from ..ir.progress import Progress
from .unwritten import is_poisoned, poison

T = TypeVar("T")

__all__ = ["check_materialised", "copy_into", "copy_to_ties", "first_meta", "init_weights",
           "is_meta_model", "meta_parameters", "name_seed", "on_meta", "recompute_buffers",
           "to_empty"]

log = logging.getLogger(__name__)


def is_meta_model(model: torch.nn.Module) -> bool:
    """True when any parameter or buffer of `model` is on the meta device."""
    return first_meta(_named_state(model)) is not None


def on_meta(tree: T) -> T:
    """`tree` with every tensor replaced by a meta tensor of its shape and dtype (the example
    inputs a meta model is captured with)."""
    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)


def first_meta(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The first name whose tensor is on the meta device, else None."""
    return next((n for n, t in named if t.is_meta), None)


def to_empty(tensors: Mapping[str, tuple[tuple[int, torch.Tensor], ...]],
             devices: Mapping[int, torch.device]) -> list[torch.Tensor]:
    """Give every meta tensor of a stage in `devices` (stage -> its device) memory there,
    in place, filled with poison (unwritten.py: what nothing writes, so a tensor left unwritten
    is found); returns the tensors allocated. `tensors` is the program's name -> (stage,
    tensor) table; a tensor no stage reads (stage -1) goes with stage 0, as the runtime keeps
    it."""
    todo: dict[int, tuple[torch.Tensor, torch.device]] = {}
    for copies in tensors.values():
        for stage, tensor in copies:
            device = devices.get(0 if stage == -1 else stage)
            if device is not None and tensor.is_meta:
                todo[id(tensor)] = (tensor, device)
    _forget_fakes([t for t, _ in todo.values()])
    for tensor, device in todo.values():
        real = torch.empty_like(tensor, device=device)
        if isinstance(tensor, torch.nn.Parameter):
            real = torch.nn.Parameter(real, requires_grad=tensor.requires_grad)
        # `.data =` cannot turn a meta tensor into a real one; swapping the two objects'
        # contents keeps the Python object (as torch's swap-on-conversion mode does)
        torch.utils.swap_tensors(tensor, real)
        poison(tensor)
    return [t for t, _ in todo.values()]


def _forget_fakes(tensors: list[torch.Tensor]) -> None:
    """Drop the fake-tensor memo entries (torch's `WeakIdKeyDictionary`s, from capture and
    costing) that still map these meta tensors to their fakes: `swap_tensors` refuses a tensor
    something holds a weak reference to, and a memo of the meta tensor would be stale anyway.
    The heap holds weak proxies too: `isinstance` on a dead one raises ReferenceError, so the
    scan asks each object's own type, which a proxy answers without its referent."""
    held = [t for t in tensors if weakref.getweakrefcount(t)]
    if not held:
        return
    for obj in gc.get_objects():
        if issubclass(type(obj), WeakIdKeyDictionary):
            for tensor in held:
                if tensor in obj:
                    del obj[tensor]


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (torch's seed, a module's qualified name): stable across processes
    and Python runs (unlike `hash`)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(model: torch.nn.Module, own: Mapping[str, torch.Tensor],
                 fn: Callable[[torch.nn.Module], None] | None = None, *,
                 buffers: Collection[str] = ()) -> list[str]:
    """Run `fn(module)` (default: the module's own `reset_parameters()`) for every submodule of
    `model` with a parameter of its own (not its children's) among `own` (this process's
    tensors by name), and for every one holding a buffer named in `buffers` (this process's
    buffers still unwritten) that `fn` can initialise: any with `fn` given, else one with a
    `reset_parameters()` (BatchNorm's resets its running statistics). Each runs under a
    generator seeded by `name_seed(torch.initial_seed(), name)`, on every device type. Returns
    the qualified names of the modules initialised.

    For the call, the module holds this process's tensors under its attribute names; a sharded
    one (a DTensor, fsdp=True) is initialised whole, one module at a time, and each rank keeps
    its shard: the weights do not depend on the sharding either."""
    seed = torch.initial_seed()
    todo, bare = [], []
    for name, module in model.named_modules():
        params = any(_join(name, n) in own for n, p in module._parameters.items()
                     if p is not None)
        held = any(_join(name, n) in buffers for n, b in module._buffers.items() if b is not None)
        if not (params or held):
            continue
        if fn is None and _reset(module) is None:
            if params:
                bare.append(name or type(module).__name__)
            continue  # a buffer no reset_parameters() covers stays unwritten: the step names it
        todo.append((name, module))
    if bare:
        raise ConfigError(
            f"init_weights: {bare[0]!r}{f' and {len(bare) - 1} more' if len(bare) > 1 else ''}"
            f" hold parameters but have no reset_parameters(); pass fn=, a function that "
            f"initialises one module (a transformers model's own: fn=model._init_weights)")
    done = []
    progress = Progress(log, "initialising weights", len(todo), unit="modules")
    for name, module in todo:
        progress.advance()
        run = fn if fn is not None else _reset(module)
        assert run is not None
        with _holding(module, name, own) as held_now:
            devices = sorted({t.device for t in held_now.values() if t.device.type == "cuda"},
                             key=str)
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(name_seed(seed, name))
                with torch.no_grad():
                    run(module)
        done.append(name)
    progress.done()
    return done


def recompute_buffers(model: torch.nn.Module, own: Mapping[str, torch.Tensor],
                      names: Collection[str]) -> list[str]:
    """Recompute the buffers `names` (non-persistent: in no checkpoint; just allocated, so
    poisoned) as transformers' `from_pretrained` does after building on meta: the nearest
    enclosing `PreTrainedModel`'s `_init_weights(module)` for each module holding one (a
    rotary embedding's `inv_freq` from its `rope_init_fn`, BERT's `position_ids`), with every
    other tensor of the module flagged as initialised so that transformers' guarded init
    functions leave it alone. Returns the names now written; the others (a module the library
    does not recompute, or no transformers model) are left for the step to refuse."""
    if "transformers" not in sys.modules or not names:
        return []
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    by_module: dict[str, list[str]] = {}
    for name in names:
        prefix, _, attr = name.rpartition(".")
        by_module.setdefault(prefix, []).append(attr)
    done = []
    for prefix, attrs in by_module.items():
        parts = prefix.split(".") if prefix else []
        owner = next((m for m in (model.get_submodule(".".join(parts[:i]))
                                  for i in range(len(parts), -1, -1))
                      if isinstance(m, PreTrainedModel)), None)
        if owner is None:
            continue
        module = model.get_submodule(prefix)
        with _holding(module, prefix, own) as held:
            others = [t for a, t in held.items() if a not in attrs]
            empty = [t for t in others if is_poisoned(t)]
            flags = [(t, t.__dict__.get("_is_hf_initialized", _ABSENT)) for t in others]
            for t in others:
                setattr(t, "_is_hf_initialized", True)
            try:
                with torch.random.fork_rng(devices=[]), guard_torch_init_functions():
                    with torch.no_grad():
                        owner._init_weights(module)
            finally:
                for t, flag in flags:
                    if flag is _ABSENT:
                        delattr(t, "_is_hf_initialized")
                    else:
                        setattr(t, "_is_hf_initialized", flag)
            for t in empty:  # what the call wrote besides its buffers is still to be filled
                poison(t)
            done += [_join(prefix, a) for a in attrs if a in held and not is_poisoned(held[a])]
    return done


_ABSENT = object()


@contextlib.contextmanager
def _holding(module: torch.nn.Module, prefix: str,
             own: Mapping[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """`module` with this process's tensors in place of its own (a DTensor's as a whole
    tensor, poisoned, then copied into its shard), by attribute name; its own put back after."""
    from torch.distributed.tensor import DTensor

    tables: list[dict[str, Any]] = [module._parameters, module._buffers]
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    held: dict[str, torch.Tensor] = {}
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []
    for table in tables:
        for attr, tensor in list(table.items()):
            target = own.get(_join(prefix, attr))
            if tensor is None or target is None:
                continue
            swapped.append((table, attr, tensor))
            if isinstance(target, DTensor):
                full = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                poison(full)  # what the call leaves unwritten stays findable in the shard
                if isinstance(tensor, torch.nn.Parameter):
                    full = torch.nn.Parameter(full, requires_grad=tensor.requires_grad)
                whole.append((full, target))
                target = full
            table[attr] = target
            held[attr] = target
    try:
        yield held
        with torch.no_grad():
            for full, target in whole:
                copy_into(target, full)
    finally:
        for table, attr, tensor in swapped:
            table[attr] = tensor


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def copy_to_ties(tensors: Mapping[str, tuple[tuple[int, torch.Tensor], ...]],
                 own: Mapping[str, torch.Tensor]) -> None:
    """Copy each of this process's tensors (`own`, by name) into the program's other real
    copies of it (a tied weight read by stages on other devices)."""
    with torch.no_grad():
        for name, copies in tensors.items():
            source = own.get(name)
            if source is None:
                continue
            for _, tensor in copies:
                if tensor is not source and not tensor.is_meta:
                    tensor.copy_(source)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real (a RoPE table
    computed at construction keeps its values): the `init_empty_weights` convention of
    transformers checkpoints, whose non-persistent buffers are not stored.

        with pipecompile.meta_parameters():
            model = LlamaForCausalLM(config)
    """
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str,
                         param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tie re-registers a meta one: keep it
            module._parameters[name] = torch.nn.Parameter(param.to("meta"),
                                                          requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def copy_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a checkpoint's whole tensor into `target`: a sharded parameter (a DTensor, under
    fsdp=True) takes its own shard, cut locally without communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        whole = distribute_tensor(whole.to(target.device), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target = target.to_local()
    target.copy_(whole)


def check_materialised(named: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Raise if any of this process's tensors is still on the meta device."""
    name = first_meta(named)
    if name is not None:
        raise ConfigError(
            f"{where}: {name!r} is still on the meta device (the model was built on meta); "
            f"call pipe.to_empty() and then pipe.load_weights(path) or pipe.init_weights() "
            f"before running the pipeline")


def _reset(module: torch.nn.Module) -> Callable[[torch.nn.Module], None] | None:
    reset = getattr(module, "reset_parameters", None)
    return None if not callable(reset) else (lambda m: reset())


def _named_state(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under each name it has (a tied one under all of them)."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
