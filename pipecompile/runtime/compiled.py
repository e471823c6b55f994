"""Optional stage compilation (`compile(..., compile_stages=True)`): each stage graph through
`torch.compile` (inductor).

    compile_stage(module, index) -> CompiledStage    an nn.Module the StageWorker runs as is

The wrapper registers the stage graph as its only submodule, so `parameters()` and `buffers()`
are the graph's own objects (the Pipeline exposes them and optimizers hold them); only the call
goes through the compiled function. The sizes capture kept symbolic (batch, sequence) are
dynamic from the first call (`maybe_mark_dynamic` on each input; the others static, so that a
sequence length equal to the hidden size is not specialised with it): micro-batches of another
batch or sequence size reuse the compiled code instead of recompiling. Grad mode is guarded on, so a stage compiles once for training forwards and once
more for forwards without autograd (checkpointed first forwards, validation, `pipe(x)`).

A compiled region's backward is one autograd node: zero-bubble I cannot stop at the frontier
nodes inside it, so a compiled stage's I runs its whole backward (weight gradients included)
and W only frees the micro-batch (`CompiledBackward`, backwards.py). The cost: such a stage's W
fills no bubbles. Letting W re-run the compiled node from I's recorded gradient would compute
the whole backward twice, and AOTAutograd's donated buffers refuse the retained graph anyway.

A failure of torch.compile (no C++ compiler, an op dynamo or inductor cannot handle) is raised
as a `StageExecutionError` naming the stage and suggesting `compile_stages=False`, not hidden by
a fallback: the caller asked for compiled stages, and a silent fallback would make timings
taken with the option mean something else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.exc import TorchDynamoException

from ..errors import StageExecutionError

__all__ = ["CompiledStage", "compile_stage", "compiled_graphs"]


class CompiledStage(torch.nn.Module):
    """Stage graph `graph` run through torch.compile; its tensors stay the graph's own."""

    def __init__(self, graph: torch.nn.Module, index: int):
        super().__init__()
        self.graph = graph  # registered: parameters()/buffers() yield the graph's objects
        self.index = index
        self.dynamic = _symbolic_dims(graph)
        # kept outside the module tree (an OptimizedModule would list the tensors again
        # under other names)
        self.__dict__["_compiled"] = torch.compile(
            graph, dynamic=None if self.dynamic is not None else True, backend="inductor")

    def forward(self, *args: Any) -> Any:
        # a micro-batch slice is a view of the whole batch, and dynamo guards on its base's
        # sizes too (a recompile when only the batch changes): hand it the slice alone
        args = tuple(a.detach() if isinstance(a, torch.Tensor) and a._is_view()
                     and not a.requires_grad else a for a in args)
        for arg, dims in zip(args, self.dynamic or ()):
            for dim in dims:  # "maybe": a size of 1 may still be specialised, without error
                torch._dynamo.maybe_mark_dynamic(arg, dim)
        try:
            return self.__dict__["_compiled"](*args)
        except TorchDynamoException as exc:
            raise StageExecutionError(
                f"torch.compile failed for stage {self.index}: {_reason(exc)}; pass compile_stages=False to run the stage graphs "
                f"uncompiled") from exc


def compile_stage(module: torch.nn.Module, index: int) -> CompiledStage:
    """Stage `index`'s graph `module` wrapped to run compiled (compiles on its first call)."""
    if isinstance(module, CompiledStage):
        return module
    return CompiledStage(module, index)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (recompilations included)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


def _symbolic_dims(graph: torch.nn.Module) -> list[tuple[int, ...]] | None:
    """Per input of the stage graph, the dimensions capture kept symbolic (batch, sequence),
    from the placeholders' example values; None where the graph does not record them."""
    nodes = getattr(graph, "graph", None)
    if nodes is None:
        return None
    dims: list[tuple[int, ...]] = []
    for node in nodes.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            if "val" not in node.meta:
                return None
            dims.append(())
            continue
        dims.append(tuple(i for i, size in enumerate(val.shape)
                          if isinstance(size, torch.SymInt)))
    return dims


def _reason(exc: BaseException) -> str:
    """What went wrong, in a line: the backend's own error where dynamo wrapped one."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, BaseException):
        exc = inner
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
