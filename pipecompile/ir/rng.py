"""Per-micro-batch random streams: dropout masks that do not depend on where the cuts are.

By default (`rng="global"`) random ops draw from torch's global generator, as in eager PyTorch:
a pipelined step draws in schedule order, so its masks differ from the unsplit model's and
change with the stage count and schedule. With `rng="per-microbatch"` the graph pass
`seed_random_ops` wraps every random node (an aten op tagged `nondeterministic_seeded`:
dropout, bernoulli, rand, randn, ...) so that it draws from a generator seeded with

    derive_seed(seed, micro-batch index, the node's name, step)

the micro-batch index and the step coming from `microbatch(i, step=s)`, a context the stage
worker sets around each forward (and around recomputation, which therefore redraws the same
mask; each training step draws new masks). Node names are those
of the captured graph, the same for any split: the same seed gives the same step on 1, 2 or 4
stages under any schedule. Outside a `microbatch` context (cost annotation, fake tensors) the
op runs unchanged.

An opaque module (kept as one eager call, `capture.opaque`) whose recorded run drew random
numbers (PhiMoE's router: jitter inside a custom autograd.Function) cannot have its ops wrapped:
the pass installs a copy of it whose forward runs under `seeded_call` as a whole, on the stream
derive_seed(seed, micro-batch, "module:<its path>", step). Its draws then do not depend on the
cuts either (the path is the same for any split).

Under rng="global" a checkpointed stage also seeds its graph's random ops, from one draw of the
global generator per forward (runtime/forwards.py): its recomputation must redraw the
forward's masks, and other device threads draw from the same generator in between.
"""

from __future__ import annotations

import copy
import hashlib
import threading
from typing import Any

import torch
import torch.fx as fx

from .nodes import recreate_as_call

__all__ = ["RNG_MODES", "generator_lock", "derive_seed", "microbatch", "seed_random_ops",
           "seeded_call", "unseed", "is_random", "draws_random", "module_seed"]

_SEED_ATTRIBUTE = "_pipecompile_seed"  # set on an opaque module's copy that runs seeded

RNG_MODES = ("global", "per-microbatch")

_context = threading.local()  # .key: (micro-batch, step) this thread is running
# Random ops without a generator argument (dropout) draw from the process-wide generator:
# device threads take turns to seed it, draw and restore it. Whoever else sets that generator's
# state while device threads run (a checkpointed stage restoring its forward's random state)
# takes this lock too, or it could reseed the generator between another thread's seed and draw.
generator_lock = threading.Lock()


def derive_seed(seed: int, index: int, name: str, step: int = 0) -> int:
    """A 63-bit seed from (seed, micro-batch index, node name, step), stable across processes."""
    digest = hashlib.blake2b(f"{seed}:{step}:{index}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class microbatch:  # noqa: N801 - used as a function: `with microbatch(i, step=s):`
    """Random ops of seeded graphs run in this thread draw the stream of micro-batch `index`
    of training step `step` (a class, not a generator: entered on every forward)."""

    __slots__ = ("key", "previous")

    def __init__(self, index: int | None, *, step: int = 0):
        self.key = None if index is None else (index, step)

    def __enter__(self) -> None:
        self.previous = getattr(_context, "key", None)
        _context.key = self.key

    def __exit__(self, *exc: Any) -> None:
        _context.key = self.previous


def seeded_call(op: Any, name: str, seed: int, *args: Any, **kwargs: Any) -> Any:
    """`op(*args, **kwargs)` drawing from derive_seed(seed, current micro-batch, name)."""
    key = getattr(_context, "key", None)
    if key is None:
        return op(*args, **kwargs)
    cuda = sorted({t.device.index or 0 for t in _tensors(args, kwargs) if t.is_cuda})
    value = derive_seed(seed, key[0], name, step=key[1])
    with generator_lock, torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(value)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(value)
        return op(*args, **kwargs)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def is_random(node: fx.Node) -> bool:
    """An aten op that draws from a generator (see `draws_random`)."""
    return node.op == "call_function" and draws_random(node.target, node.args, node.kwargs)


def draws_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """Whether calling aten `op` on these arguments draws from a generator. Attention with a
    constant `dropout_p` of 0 is tagged as random but draws nothing: seeding it would only cost
    a lock per call (and a graph break under torch.compile)."""
    if not (isinstance(op, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded in op.tags):
        return False
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            p = args[i] if i < len(args) else kwargs.get("dropout_p", 0.0)
            return not (isinstance(p, (int, float)) and p == 0)
    return True


def module_seed(module: torch.nn.Module) -> int | None:
    """The seed an opaque module's copy runs its forward under (`seed_random_ops`), or None."""
    return getattr(module, _SEED_ATTRIBUTE, None)


def _draws(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node` calls an opaque module whose recorded run drew random numbers."""
    if node.op != "call_module":
        return False
    spec = getattr(type(gm.get_submodule(str(node.target))), "_pipecompile_opaque", None)
    return bool(getattr(spec, "random", False))


def seed_random_ops(gm: fx.GraphModule, seed: int) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """A copy of `gm` whose random nodes call `seeded_call(op, node name, seed, ...)`, and whose
    opaque modules that draw random numbers run seeded as a whole; returns it and the names of
    those nodes and modules. Each node keeps its name and metadata."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    seeded, modules = [], []
    graph._codegen = copy.deepcopy(gm.graph._codegen)  # e.g. pytree in/out handling
    for node in gm.graph.nodes:
        if is_random(node):
            env[node] = recreate_as_call(graph, node, seeded_call, env,
                                         prefix=(node.target, node.name, int(seed)))
            seeded.append(node.name)
            continue
        if _draws(gm, node) and node.target not in modules:
            modules.append(node.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.lint()
    out = fx.GraphModule(gm, graph)
    for path in modules:
        clone = copy.copy(gm.get_submodule(path))
        object.__setattr__(clone, _SEED_ATTRIBUTE, int(seed))
        _replace(out, gm, path, clone)
    return out, tuple(seeded + modules)


def _replace(out: torch.nn.Module, source: torch.nn.Module, path: str,
             module: torch.nn.Module) -> None:
    """Set `out`'s submodule at `path` to `module`, copying each parent `out` shares with
    `source` first (the pass leaves its input as it was)."""
    *parents, name = path.split(".")
    parent = out
    for part in parents:
        child, original = getattr(parent, part), getattr(source, part)
        if child is original:
            child = copy.copy(child)
            child._modules = dict(child._modules)
            setattr(parent, part, child)
        parent, source = child, original
    setattr(parent, name, module)


def unseed(graph: fx.Graph) -> None:
    """Turn `seeded_call` nodes back into the plain ops, in place (eval-mode rewrites look for
    the ops themselves)."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is seeded_call:
            node.target = node.args[0]
            node.args = tuple(node.args[3:])
