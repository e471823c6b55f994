"""Zero-bubble W at the op: a Linear whose weight gradient waits in a store until W.

`split_backward` splits a stage's backward by walking its autograd graph on every micro-batch
and calling the engine once per frontier node; on small CPU stages that Python made I + W cost
1.2-1.3x one fused backward. Here the split is compiled into the graph instead, as DualPipe's
`WeightGradStore` does: `defer_weight_grads` rewrites each `aten.linear` on a parameter into
`deferred_linear`, whose backward (part of I's one ordinary `autograd.backward` call) computes
only the input gradient and queues (input, output gradient) in the micro-batch's store. W runs
the queued matmuls: into `.grad` in place (`addmm_`, Megatron-LM's gradient accumulation
fusion) where only this stage holds the parameter and `.grad` exists, else through one autograd
node whose backward returns them, so that AccumulateGrad adds them as it adds any gradient
(its lock against another thread's stage sharing the parameter, hooks). On the GPT and MLP
stages of `bench/zero_bubble.py ratio`, I + W measured 0.96-1.04x a fused backward.

    gm = defer_weight_grads(stage_graph)        # None: nothing to defer
    store = WeightGradStore()                   # one per micro-batch
    with collecting(store): out = gm(x)         # forward: linears remember the store
    autograd.backward(out, g)                   # I: input grads (and the other parameters')
    store.flush()                               # W: every deferred weight and bias gradient

Parameters of other ops (LayerNorm, embeddings) get their gradients in I: their backward
computes them with the input gradient in one kernel. A stage with convolutions keeps the
frontier split (`defer_weight_grads` returns None), which also splits their kernels.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["WeightGradStore", "collecting", "defer_weight_grads", "deferred_linear"]

_LINEAR = torch.ops.aten.linear.default
_CONVOLUTIONS = ("aten.conv", "aten.cudnn_convolution")  # conv1d..3d, convolution, transposed
_local = threading.local()


class WeightGradStore:
    """The weight-gradient work one micro-batch's I queued for its W. `exclusive`: ids of the
    parameters no other stage of this process holds (W may add into their `.grad` itself)."""

    def __init__(self, exclusive: frozenset[int] = frozenset()) -> None:
        self.exclusive = exclusive
        self.queued: list[tuple[tuple, torch.Tensor, torch.Tensor]] = []

    def flush(self) -> None:
        """Compute every queued gradient and accumulate it into the parameters' `.grad`."""
        rest = []
        for (weight, bias), x, g in self.queued:
            if g.dim() != 2:
                g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            if self._fusable(weight, g) and (bias is None or self._fusable(bias, g)):
                # gradient accumulation fusion (as Megatron-LM's): the product is added into
                # .grad by the matmul itself, with no temporary and no second pass over it
                with torch.no_grad():
                    weight.grad.addmm_(g.t(), x)
                    if bias is not None and bias.requires_grad:
                        bias.grad.add_(g.sum(0))
            else:
                rest.append(((weight, bias), x, g))
        self.queued = rest
        params = list({id(p): p for (weight, bias), _, _ in rest
                       for p in (weight, bias) if p is not None and p.requires_grad}.values())
        if params:
            # one node whose backward returns the gradients: the engine accumulates them as
            # any other (AccumulateGrad's lock against other threads' stages sharing a
            # parameter, hooks, and it takes a fresh gradient over instead of copying it)
            with torch.enable_grad():
                root = _Accumulate.apply(self, *params)
            torch.autograd.backward(root)  # its backward (`gradients`) empties the queue

    def _fusable(self, param: torch.Tensor, g: torch.Tensor) -> bool:
        """May W add into `param.grad` in place, bypassing autograd's accumulation? Only where
        nothing else could see the difference: this stage alone holds the parameter (no other
        thread's AccumulateGrad adds to it), .grad exists in the gradient's dtype and layout,
        and no hook waits for the accumulation."""
        grad = param.grad
        return (grad is not None and id(param) in self.exclusive and grad.dtype == g.dtype
                and grad.is_contiguous() and not param._backward_hooks
                and not param._post_accumulate_grad_hooks)

    def gradients(self, params: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        """The queued work's gradient of each of `params` (inputs already 2-d)."""
        grads: dict[int, torch.Tensor] = {}
        for (weight, bias), x, g in self.queued:
            # y = x W^T + b:  dW = g^T x,  db = the sum of g over every leading dimension
            _add(grads, weight, g.t().mm(x))
            if bias is not None and bias.requires_grad:
                _add(grads, bias, g.sum(0))
        self.queued = []
        return [grads.pop(id(p), None) for p in params]


def _add(grads: dict, param: torch.Tensor, value: torch.Tensor) -> None:
    if value.dtype != param.dtype:  # autocast: cast as the backward of its cast would
        value = value.to(param.dtype)
    known = grads.get(id(param))
    grads[id(param)] = value if known is None else known + value  # a tie within the stage


class _Accumulate(torch.autograd.Function):
    """W as an autograd node: its inputs are the parameters, its backward the queued work."""

    @staticmethod
    def forward(ctx: Any, store: WeightGradStore, *params: torch.Tensor) -> torch.Tensor:
        ctx.store = store
        ctx.params = params  # not saved tensors: parameters, and read only by backward
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        return (None, *ctx.store.gradients(ctx.params))


@contextlib.contextmanager
def collecting(store: WeightGradStore) -> Iterator[None]:
    """Deferred linears run in this block (on this thread) queue their W into `store`."""
    previous = getattr(_local, "store", None)
    _local.store = store
    try:
        yield
    finally:
        _local.store = previous


class _DeferredLinear(torch.autograd.Function):
    """F.linear whose backward returns the input gradient only and queues the rest. `params`
    (weight, bias) are the parameters the queued gradients belong to: under autocast the
    tensors the function gets are their lower-precision casts."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                params: tuple, store: WeightGradStore) -> torch.Tensor:
        ctx.params = params
        ctx.store = store
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        ctx.store.queued.append((ctx.params, x, g))
        return g.matmul(weight), None, None, None, None


def deferred_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """`aten.linear` that defers its weight gradient to the store `collecting` set, if any."""
    store = getattr(_local, "store", None)
    if store is None or not x.requires_grad or not weight.requires_grad \
            or not torch.is_grad_enabled():
        # (an input without gradient: the plain op, whose backward is then all weight work)
        return _LINEAR(x, weight, bias)
    params = (weight, bias)
    # detached: the function's only differentiable input is x, so I's engine does not visit
    # the parameters' AccumulateGrad nodes with nothing to add
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return _DeferredLinear.apply(x, weight, bias, params, store)
    # autocast runs linear in its lower precision: cast as it does (floating tensors other
    # than float64), then run the function without it, on what backward will see
    dtype = torch.get_autocast_dtype(device)
    x, weight = (t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (x, weight))
    if bias is not None and bias.is_floating_point() and bias.dtype != torch.float64:
        bias = bias.to(dtype)
    with torch.autocast(device, enabled=False):
        return _DeferredLinear.apply(x, weight, bias, params, store)


def defer_weight_grads(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of stage graph `gm` whose linears on parameters defer their weight gradients;
    None if it has none, or has convolutions (the frontier split handles those)."""
    params = {name for name, _ in gm.named_parameters()}
    found = False
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # the same calling convention
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith(_CONVOLUTIONS):
            return None
        copy = graph.node_copy(node, lambda n: env[n])
        env[node] = copy
        if node.op == "call_function" and node.target is _LINEAR and _is_param(node, 1, params):
            copy.target = deferred_linear
            found = True
    if not found:
        return None
    return fx.GraphModule(gm, graph, type(gm).__name__)


def _is_param(node: fx.Node, index: int, params: set[str]) -> bool:
    arg = node.args[index] if len(node.args) > index else None
    return isinstance(arg, fx.Node) and arg.op == "get_attr" and str(arg.target) in params
