"""profile: measure every block's forward, input-gradient and weight-gradient time for real.

Input: a `LinearGraph`, its `CostTable` and one real micro-batch. Output: a new `CostTable`
whose block times are medians of measured runs (`NumericBlockCost.measured` is True).

The captured graph is first run once on the micro-batch to get every intermediate value; then
each block is timed on its own with those values as inputs (`clock.elapsed`: CUDA events on
a GPU; not torch.utils.benchmark, as a forward, its input gradient and its weight gradient run
once each in turn, the first's graph feeding the others):

    forward   the block's nodes, autograd recording
    I         autograd.grad(outputs, block inputs, retain_graph=True)
    W         autograd.grad(outputs, inputs + parameters) minus I   (as annotate counts FLOPs)

Buffers (BatchNorm running statistics) and the RNG state are restored afterwards, so profiling
leaves the model as it found it. Blocks run where the model's parameters live.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

import torch
import torch.fx as fx

from ..errors import CaptureError
from ..ir.records import CostTable, LinearGraph, NodeRole
from ..runtime.microbatch import split_microbatches
from ..passes.annotate import with_measured_times
from ..ir.nodes import call_node, getattr_path as _getattr_path, preserve_buffers
from .clock import elapsed, sync_device

__all__ = ["profile_blocks", "record_values", "sync_device"]


def profile_blocks(
    linear: LinearGraph,
    costs: CostTable,
    args: tuple,
    kwargs: Mapping[str, Any],
    *,
    microbatches: int,
    repeats: int = 5,
) -> CostTable:
    """`costs` with measured (forward, backward-input, backward-weight) seconds per block."""
    captured = linear.captured
    gm = captured.module
    mb = split_microbatches(args, kwargs, None, microbatches)[0]
    flat = captured.flatten_inputs(mb.args, mb.kwargs)
    with torch.random.fork_rng(devices=[]), preserve_buffers(gm):
        env = record_values(gm, flat)
        nodes = {n.name: n for n in gm.graph.nodes}
        measured = {
            block.index: _time_block(block.nodes, nodes, linear.roles, gm, env, repeats)
            for block in linear.blocks
        }
    return with_measured_times(costs, measured)


def record_values(gm: fx.GraphModule, flat: list) -> dict[str, Any]:
    """Every node's value on one real run (no autograd; buffers and RNG left as they were)."""
    env: dict[str, Any] = {}
    failed: list[fx.Node] = []

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            try:
                result = super().run_node(n)
            except Exception:
                failed.append(n)
                raise
            env[n.name] = result
            return result

    with torch.no_grad(), torch.random.fork_rng(devices=[]), preserve_buffers(gm):
        try:
            Recorder(gm).run(*flat)
        except Exception as exc:  # noqa: BLE001 - the user's graph failed: name the node
            if not failed:
                raise
            raise _run_failed(failed[0], flat, exc) from exc
    return env


def _run_failed(node: fx.Node, flat: list, exc: Exception) -> CaptureError:
    """The captured graph failed on a micro-batch: name the node and where the model wrote it.
    The common cause is a size the model fixes (`h.reshape(4, 8)`): it held for the whole
    example batch but not for a micro-batch of it."""
    rows = next((v.shape[0] for v in flat if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    at = f" ({trace[-2].strip()}: {trace[-1].strip()})" if len(trace) >= 2 else ""
    size = f" of {rows} row{'s' if rows != 1 else ''}" if rows is not None else ""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return CaptureError(
        f"the captured graph failed at node {node.name!r}{at} on a micro-batch{size}: "
        f"{type(exc).__name__}: {first}. If the model fixes its batch size (a reshape or view "
        f"to constant sizes such as h.reshape(4, 8)), compute it from the input (h.reshape(-1, "
        f"8), x.shape[0]) so that micro-batches run, or compile with microbatches=1")


def _time_block(block_nodes, nodes, roles, gm, env, repeats) -> tuple[float, float, float]:
    samples = [_run_once(block_nodes, nodes, roles, gm, env) for _ in range(repeats + 1)][1:]
    return tuple(statistics.median(s[i] for s in samples) for i in range(3))  # type: ignore


def _run_once(block_nodes, nodes, roles, gm, env) -> tuple[float, float, float]:
    block = set(block_nodes)
    local: dict[str, Any] = {}
    inputs: list[torch.Tensor] = []
    params: dict[int, torch.Tensor] = {}
    for name in block_nodes:
        for arg in nodes[name].all_input_nodes:
            if arg.name in local or arg.name in block:
                continue
            if roles[arg.name] == NodeRole.PARAM:
                value = _getattr_path(gm, arg.target)
                if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                    params[id(value)] = value
            else:
                value = env[arg.name]
                if (isinstance(value, torch.Tensor) and value.is_floating_point()
                        and roles[arg.name] == NodeRole.COMPUTE):
                    value = value.detach().requires_grad_(True)
                    inputs.append(value)
            local[arg.name] = value
    device = next((v.device for v in (*inputs, *params.values())), None)

    def forward() -> None:
        for name in block_nodes:
            node = nodes[name]
            a = fx.node.map_arg(node.args, lambda n: local[n.name])
            k = fx.node.map_arg(node.kwargs, lambda n: local[n.name])
            local[name] = call_node(gm, node, a, k)

    t_f = elapsed(forward, device)
    outputs = [local[n] for n in block_nodes
               if isinstance(local[n], torch.Tensor) and local[n].requires_grad
               and any(u.name not in block for u in nodes[n].users)]
    grads = [torch.ones_like(o) for o in outputs]
    t_i = t_all = 0.0
    if outputs and inputs:
        t_i = elapsed(lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True,
                                                  allow_unused=True), device)
    if outputs and (inputs or params):
        t_all = elapsed(lambda: torch.autograd.grad(outputs, inputs + list(params.values()),
                                                    grads, allow_unused=True), device)
    return t_f, t_i, max(t_all - t_i, 0.0)

