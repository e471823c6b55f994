"""Backward split into input gradients (I) and weight gradients (W) without recomputation.

Zero-bubble stages whose weights sit in linears split at the op instead (`weight_store`: no
graph walk per micro-batch); this frontier split serves the others: stages with convolutions,
whose kernels it splits too, and first stages, whose W is their whole backward.

Zero-bubble schedules (Qi et al. 2024) run I as soon as the next stage's gradient arrives and
defer W to fill bubbles. Two plain `autograd.grad` calls (inputs, then parameters) would run the
chain from the outputs to the parameters twice. Instead, I records the gradient arriving at
every *frontier* node: an autograd node on a path to the stage inputs that also has an edge into
a part of the graph that leads only to parameters (a Linear's AddmmBackward, say). W then starts
from those nodes with the recorded gradients (`GradientEdge` outputs) and asks only for the
parameters behind each, so it runs just the weight-gradient kernels.

    outputs ──▶ N3 ──▶ N2 ──▶ N1 ──▶ input          I: outputs → input, recording grads at N*
                │       │       │
                ▼       ▼       ▼                   W: N* → their parameters only
               W3      W2      W1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["WeightWork", "backward_input", "backward_weight"]


@dataclass
class WeightWork:
    """What W needs: per frontier node its recorded output gradients and its parameters (plus,
    for a node whose weight-only backward is unsafe, its input-side edges)."""

    groups: list[tuple[list[GradientEdge], list, list[torch.Tensor]]] = field(default_factory=list)


def backward_input(
    roots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """Gradients of `inputs`, and the work W will need to compute the gradients of `params`."""
    if not inputs:  # the first stage: W is the whole backward, I has nothing to do
        work = WeightWork([([get_gradient_edge(r) for r in roots if r.grad_fn is not None],
                            [g for r, g in zip(roots, grads) if r.grad_fn is not None],
                            list(params))])
        return [], work if work.groups[0][0] and params else WeightWork()
    # parameters by id: the walk meets each as the `.variable` of its AccumulateGrad node
    # (get_gradient_edge would build a view of every parameter on every micro-batch)
    param_of = {id(p): p for p in params}
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    graph = _Graph([r.grad_fn for r in roots if r.grad_fn is not None], input_nodes, param_of)
    work = WeightWork()
    for root, grad in zip(roots, grads):
        node = root.grad_fn
        if node is not None and not graph.reach[node] and params:
            # this output depends on parameters only: W takes it whole (all of them:
            # autograd skips the unreachable ones, no graph walk needed)
            work.groups.append(([get_gradient_edge(root)], [grad], list(params)))
    frontier: dict = {}
    for node, children in graph.children.items():
        if not graph.reach[node]:
            continue
        ps = {k: p for c in children if not graph.reach[c] for k, p in graph.below[c].items()}
        if ps:
            frontier[node] = list(ps.values()) + _input_edges(node, graph.reach)

    if _nested_use(frontier, graph):
        # W of the outer use would also flow through I's chain into the inner one and count it
        # twice: this stage's backward runs whole in I (exact; W has nothing left to do).
        whole = torch.autograd.grad(list(roots), list(inputs), list(grads), retain_graph=True,
                                    allow_unused=True)
        torch.autograd.backward(list(roots), list(grads), inputs=list(params))
        return list(whole), WeightWork()
    # One autograd call: the inputs' gradients and, captured on the way, the gradient arriving
    # at every input of every frontier node (what its W starts from); the engine runs the
    # same nodes as for the inputs alone.
    edges = [GradientEdge(node, i) for node in frontier for i in range(len(node._input_metadata))]
    wanted: list[Any] = [*inputs, *edges]  # autograd takes tensors and edges together
    result = torch.autograd.grad(list(roots), wanted, list(grads), retain_graph=True,
                                 allow_unused=True, materialize_grads=False)
    got = iter(zip(edges, result[len(inputs):]))
    for node, ps in frontier.items():
        keep = [(edge, g) for _, (edge, g) in zip(range(len(node._input_metadata)), got)
                if g is not None]
        if keep:  # else the node received no gradient: nothing flows to its parameters
            work.groups.append(([e for e, _ in keep], [g for _, g in keep], ps))
    result = result[: len(inputs)]
    return list(result), work


def backward_weight(work: WeightWork) -> None:
    """Accumulate every parameter's gradient from the recorded frontier gradients.

    `backward(inputs=params)` accumulates into `.grad` through autograd's AccumulateGrad, which
    locks the parameter: stages on one device that share a parameter (a weight used at both
    ends) run their W on different threads."""
    run = torch.autograd.Variable._execution_engine.run_backward
    for edges, grads, params in work.groups:
        # The engine directly: `autograd.backward` re-checks every gradient's shape in Python
        # (_make_grads), a quarter of W's time on small stages; I recorded these gradients from
        # the engine itself, so they match already. Arguments: keep_graph, create_graph,
        # inputs, allow_unreachable, accumulate_grad.
        run(tuple(edges), tuple(grads), True, False, tuple(params), True, True)


def _nested_use(frontier: dict, graph: "_Graph") -> bool:
    """Does a parameter feed two frontier nodes, one of which leads to the other (a weight
    applied twice in a row, like ``tanh(x @ w) @ w``)? Such a W cannot start at the outer node
    without running into the inner one; parallel uses (two branches) are fine."""
    owners: dict = {}
    for node, ps in frontier.items():
        for p in ps:
            if isinstance(p, torch.Tensor):
                owners.setdefault(id(p), []).append(node)
    for nodes in owners.values():
        if len(nodes) < 2:
            continue
        others = set(nodes)
        for start in nodes:
            seen, stack = set(), [c for c in graph.children[start] if graph.reach[c]]
            while stack:
                node = stack.pop()
                if node in others:
                    return True
                if node not in seen:
                    seen.add(node)
                    stack.extend(c for c in graph.children[node] if graph.reach[c])
    return False


# Autograd nodes whose weight-only backward must also ask for the input gradient: torch 2.13's
# CPU GroupNorm backward with output_mask [False, True, True] on a non-contiguous saved input
# (a permuted activation) crashes the process with a segmentation fault.
_WEIGHT_NEEDS_INPUT = {"NativeGroupNormBackward0"}


def _input_edges(node, reach: dict) -> list[GradientEdge]:
    """Extra W inputs that make `node` compute its input gradient too (discarded), where its
    weight-only backward is unsafe. Asking W for a GradientEdge leaves every .grad untouched."""
    if type(node).__name__ not in _WEIGHT_NEEDS_INPUT:
        return []
    saved = getattr(node, "_saved_input", None)
    if isinstance(saved, torch.Tensor) and saved.is_contiguous():
        return []
    return [GradientEdge(child, nr) for child, nr in node.next_functions
            if child is not None and reach[child]]


class _Graph:
    """One walk of the autograd graph below `roots`: every node's children, whether it leads to
    one of `targets` (the stage inputs), and the parameters (`param_of`: by id) below a node
    that does not."""

    def __init__(self, roots: list, targets: set, param_of: dict):
        self.children: dict = {}
        self.reach: dict = {}
        self.below: dict = {}  # a node that does not reach a target -> {id: parameter} below
        # Iterative post-order (graphs can be deep): a node is decided after its children.
        stack = [(n, False) for n in roots]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                kids = self.children[node]
                reach = node in targets or any(self.reach[c] for c in kids)
                self.reach[node] = reach
                if not reach:
                    variable = getattr(node, "variable", None)  # AccumulateGrad's leaf
                    param = None if variable is None else param_of.get(id(variable))
                    if param is not None:
                        self.below[node] = {id(param): param}
                    elif kids:
                        self.below[node] = {k: v for c in kids for k, v in self.below[c].items()}
                    else:
                        self.below[node] = {}
                continue
            if node in self.children:
                continue
            kids = [c for c, _ in node.next_functions if c is not None]
            self.children[node] = kids
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in self.children)
