"""Materialise a model compiled on the meta device: memory for this process's stages only.

A model built under `torch.device("meta")` is captured, costed, partitioned and split without a
byte of weights (fake tensors carry the shapes). Its stages then hold meta tensors. A process
gives real memory to the tensors of *its* stages and nothing else:

    to_empty(program, own)   each meta tensor of an own stage gets uninitialised memory on its
                             stage's device, in place (`torch.utils.swap_tensors`): the object
                             stays the same, so ties, the Pipeline's names and optimizers built
                             over pipe.parameters() keep pointing at it. Tensors that are already
                             real (a RoPE table built eagerly) keep their values, unlike
                             `nn.Module.to_empty`, which re-allocates every tensor.
    init_weights(...)        fn(module) for every original submodule holding an own tensor,
                             under a generator seeded by (torch's seed, the module's qualified
                             name): the same weights on 1, 2 or 4 stages, with any schedule.

Megatron and torchtitan seed initialisation per pipeline rank, so their weights change with the
layout; DeepSpeed seeds per layer index. Seeding by name is what makes a meta model's weights a
function of the model alone.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
from torch.nn.modules.module import _IncompatibleKeys
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from .errors import CheckpointError, ConfigError
from .weights import checkpoint_keys, read_tensors

T = TypeVar("T")

__all__ = ["check_materialised", "copy_to_ties", "first_meta", "init_weights", "is_meta_model",
           "load_weights", "meta_parameters", "name_seed", "on_meta", "to_empty"]


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
             devices: Mapping[int, torch.device]) -> int:
    """Give every meta tensor of a stage in `devices` (stage -> its device) memory there,
    in place; returns the bytes allocated. `tensors` is the program's name -> (stage, tensor)
    table; a tensor no stage reads (stage -1) goes with stage 0, as the runtime keeps it."""
    allocated = 0
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
        allocated += tensor.numel() * tensor.element_size()
    return allocated


def _forget_fakes(tensors: list[torch.Tensor]) -> None:
    """Drop the fake-tensor memo entries (torch's `WeakIdKeyDictionary`s, from capture and
    costing) that still map these meta tensors to their fakes: `swap_tensors` refuses a tensor
    something holds a weak reference to, and a memo of the meta tensor would be stale anyway."""
    held = [t for t in tensors if weakref.getweakrefcount(t)]
    if not held:
        return
    for obj in gc.get_objects():
        if isinstance(obj, WeakIdKeyDictionary):
            for tensor in held:
                if tensor in obj:
                    del obj[tensor]


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (torch's seed, a module's qualified name): stable across processes
    and Python runs (unlike `hash`)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_weights(model: torch.nn.Module, own: Mapping[str, torch.Tensor],
                 fn: Callable[[torch.nn.Module], None] | None = None) -> list[str]:
    """Run `fn(module)` (default: the module's own `reset_parameters()`) for every submodule of
    `model` with a parameter of its own (not its children's) among `own` (this process's
    tensors by name), each under a generator seeded by `name_seed(torch.initial_seed(), name)`,
    on every device type. Returns the qualified names of the modules initialised.

    For the call, the module holds this process's tensors under its attribute names; a sharded
    one (a DTensor, fsdp=True) is initialised whole, one module at a time, and each rank keeps
    its shard: the weights do not depend on the sharding either."""
    seed = torch.initial_seed()
    todo = [(name, module) for name, module in model.named_modules()
            if any(_join(name, n) in own for n, p in module._parameters.items() if p is not None)]
    if fn is None:
        bare = [name or type(module).__name__ for name, module in todo
                if _reset(module) is None]
        if bare:
            raise ConfigError(
                f"init_weights: {bare[0]!r}{f' and {len(bare) - 1} more' if len(bare) > 1 else ''}"
                f" hold parameters but have no reset_parameters(); pass fn=, a function that "
                f"initialises one module (a transformers model's own: fn=model._init_weights)")
    done = []
    for name, module in todo:
        run = fn if fn is not None else _reset(module)
        assert run is not None
        with _holding(module, name, own) as held:
            devices = sorted({t.device for t in held if t.device.type == "cuda"}, key=str)
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(name_seed(seed, name))
                with torch.no_grad():
                    run(module)
        done.append(name)
    return done


@contextlib.contextmanager
def _holding(module: torch.nn.Module, prefix: str,
             own: Mapping[str, torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`module` with this process's tensors in place of its own (a DTensor's as a whole
    tensor, copied into its shard afterwards); its own tensors put back after."""
    from torch.distributed.tensor import DTensor

    tables: list[dict[str, Any]] = [module._parameters, module._buffers]
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    held: list[torch.Tensor] = []
    whole: list[tuple[torch.Tensor, torch.Tensor]] = []
    for table in tables:
        for attr, tensor in list(table.items()):
            target = own.get(_join(prefix, attr))
            if tensor is None or target is None:
                continue
            swapped.append((table, attr, tensor))
            if isinstance(target, DTensor):
                full = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                if isinstance(tensor, torch.nn.Parameter):
                    full = torch.nn.Parameter(full, requires_grad=tensor.requires_grad)
                whole.append((full, target))
                target = full
            table[attr] = target
            held.append(target)
    try:
        yield held
        with torch.no_grad():
            for full, target in whole:
                _copy_into(target, full)
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


def load_weights(module: torch.nn.Module, path: str | os.PathLike, model_keys: Sequence[str],
                 ties: Iterable[Sequence[str]]) -> _IncompatibleKeys:
    """Load `module`'s tensors (a Pipeline: this process's, under the model's state_dict keys)
    from the checkpoint at `path` (see weights.py), reading only the tensors it holds.

    A tied weight stored once (transformers keeps `embed_tokens.weight`, not `lm_head.weight`)
    loads into every name of its group; dtypes convert to the tensor's; a shape that differs
    raises `CheckpointError`. Without state-dict hooks each tensor is copied in place as it is
    read, at most `_CHUNK_BYTES` read ahead; a model whose hooks rename keys is loaded through
    its own `load_state_dict` hooks."""
    wanted = module.state_dict(keep_vars=True)  # through the model's hooks: its own keys
    stored = checkpoint_keys(path)
    source = {k: k for k in wanted if k in stored}
    for names in ties:
        found = next((n for n in names if n in stored), None)
        for name in names:
            if found is not None and name in wanted:
                source.setdefault(name, found)
    for key, src in source.items():
        have, want = tuple(stored[src][0]), tuple(wanted[key].shape)
        if have != want:
            raise CheckpointError(
                f"{os.fspath(path)}: {src!r} has shape {list(have)} in the checkpoint but the "
                f"model's {key!r} has shape {list(want)}; is this the checkpoint of this model "
                f"(and its configuration)?")
    missing = sorted(set(wanted) - set(source))
    unexpected = sorted(set(stored) - set(model_keys))
    own = dict(_named_state(module))
    if all(own.get(k) is t for k, t in wanted.items()):
        _copy_in_chunks(path, source, own, {k: stored[k] for k in set(source.values())})
    else:  # keys renamed by the model's hooks: its load_state_dict hooks put them back
        read = read_tensors(path, set(source.values()))
        module.load_state_dict({k: read[s] for k, s in source.items()}, strict=False)
    return _IncompatibleKeys(missing, unexpected)


_CHUNK_BYTES = 64 << 20  # checkpoint bytes read before they are copied in and freed


def _copy_in_chunks(path: str | os.PathLike, source: Mapping[str, str],
                    own: Mapping[str, torch.Tensor],
                    stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Read the checkpoint's tensors a few at a time and copy each into every name it feeds."""
    targets: dict[str, list[str]] = {}
    for key, src in source.items():
        targets.setdefault(src, []).append(key)
    batch: list[str] = []
    size = 0
    for i, src in enumerate(targets):
        shape, dtype = stored[src]
        batch.append(src)
        size += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if size >= _CHUNK_BYTES or i == len(targets) - 1:
            read = read_tensors(path, batch)
            with torch.no_grad():
                for name in batch:
                    for key in targets[name]:
                        _copy_into(own[key], read[name])
            batch, size = [], 0


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


def _copy_into(target: torch.Tensor, whole: torch.Tensor) -> None:
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
