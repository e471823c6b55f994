"""How the pipeline's `loss_fn` reads the model's outputs, for the price of a vocabulary split
(planner/tensor_costs.py): split logits only a cross entropy reads are never gathered.

    loss_reads(captured, loss_fn, target) -> {flat output index: "cross entropy" | "none" |
                                             "other"}

The loss is traced as the runtime traces it (runtime/vocab_loss.py: make_fx, pre-dispatch,
fake tensors) on the captured model's outputs at their recorded sizes and `target` (the
example's, else class indices of a floating-point output's leading dims: a guess, used only
for this price; on meta, or fake tensors on the CPU or CUDA when the loss holds a tensor of
its own, such as class weights); each output it reads only through a cross entropy that lowers
(passes/vocab_loss.py `logits_readers`) is "cross entropy", one it does not read "none". No
`loss_fn` (the model returns its loss): every output "none". A loss that cannot be traced:
every output "other" (priced gathered, as the runtime then runs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ..passes.vocab_loss import logits_readers

if TYPE_CHECKING:
    from ..ir.records import CapturedModel

__all__ = ["loss_reads"]


def _devices() -> list[str]:
    """Where the loss is traced: meta first; a loss holding a tensor of its own (class
    weights) computes with it on its device, so then the CPU, then CUDA if present."""
    return ["meta", "cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _on(device: str, values: list) -> list:
    """`values` (meta tensors) as fake tensors on `device`: shapes without memory."""
    if device == "meta":
        return values
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.utils._pytree.tree_map(
            lambda t: torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.Tensor) else t, values)

#: the last few answers, each with what it was asked of (kept alive: their ids stay theirs)
_SEEN: dict[tuple[int, int, int], tuple[Any, Mapping[int, str]]] = {}


def _size(d: Any) -> int:
    try:
        return int(d)
    except Exception:  # noqa: BLE001 - a symbolic size: its hint
        hint = getattr(getattr(d, "node", None), "hint", None)
        return int(hint) if hint is not None else 1


def loss_reads(captured: "CapturedModel", loss_fn: Callable[..., Any] | None,
               target: Any = None) -> Mapping[int, str]:
    """How `loss_fn` reads each flat output of `captured` (module docstring)."""
    (out,) = [n for n in captured.module.graph.nodes if n.op == "output"]
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in flat]
    if loss_fn is None:
        return {i: "none" for i in range(len(flat))}
    key = (id(captured), id(loss_fn), id(target))
    if key in _SEEN:
        return _SEEN[key][1]
    examples = [torch.empty([_size(d) for d in v.shape], dtype=v.dtype, device="meta")
                if isinstance(v, torch.Tensor) else v for v in vals]
    if target is not None:  # the example's, as meta tensors beside the outputs
        target = torch.utils._pytree.tree_map(
            lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor)
            else t, target)
    else:
        logits = next((e for e in examples if isinstance(e, torch.Tensor)
                       and e.is_floating_point() and e.dim() >= 2), None)
        target = (torch.zeros(logits.shape[:-1], dtype=torch.long, device="meta")
                  if logits is not None else None)
    found = _trace(captured, loss_fn, examples, target)
    if len(_SEEN) >= 8:
        _SEEN.pop(next(iter(_SEEN)))
    _SEEN[key] = ((captured, loss_fn, target), found)
    return found


def _trace(captured: "CapturedModel", loss_fn: Callable[..., Any], examples: list,
           target: Any) -> Mapping[int, str]:
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss(*flat: Any) -> Any:
        *outs, tgt = flat
        return loss_fn(captured.unflatten_outputs(list(outs)), tgt)

    other = {i: "other" for i in range(len(examples))}
    traced = None
    for device in _devices():
        try:
            flat = _on(device, [*examples, target])
            traced = make_fx(loss, tracing_mode="fake", pre_dispatch=True,
                             _allow_non_fake_inputs=True)(*flat)
            break
        except Exception:  # noqa: BLE001 - not traceable: the runtime gathers, priced so
            continue
    if traced is None:
        return other
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    if len(placeholders) < len(examples):
        return other
    found = {}
    for i, node in enumerate(placeholders[:len(examples)]):
        shape = tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"),
                                                            torch.Tensor) else ()
        readers = logits_readers(node, int(shape[-1])) if shape and node.users else None
        found[i] = ("none" if not node.users else "cross entropy"
                    if readers is not None and readers.losses and not readers.outputs
                    else "other")
    return found
