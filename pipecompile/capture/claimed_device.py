"""Capture a meta-device model as if its tensors lived on the device it will train on.

A model built under `torch.device("meta")` has no data, so capture traces it without running
anything. Tracing it on its meta tensors would bake every Python branch on `tensor.device` into
the graph as the meta path: a `if x.device.type == "cpu"` in the model's code takes the wrong
side, and the stages compute something else than the model does on its device, silently.

Instead, for the capture only, every meta parameter, buffer and input is swapped for a fake
tensor (torch's `FakeTensor`: shape, dtype and device, no data) that *claims* the stage device,
so the model's code sees the device it will run on. Afterwards the model gets its own meta
tensors back, and so does the captured graph module; the graph's device literals name the
claimed device, which the split pass points at each stage's device (`passes.split`).

Only a device this torch build can serve is claimed: a fake CUDA tensor on a CPU-only build
aborts the process, so a plan for absent GPUs captures on meta as before (nothing runs there).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator, Sequence

import torch
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from ..ir.records import CapturedModel

__all__ = ["claimable", "claiming", "restore_tensors"]


def claimable(devices: Sequence[str | torch.device]) -> torch.device | None:
    """The first of `devices` this process can make fake tensors for (cpu; cuda where this
    torch has CUDA), else None (capture on meta)."""
    for name in devices:
        device = torch.device(name)
        if device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()):
            return device
    return None


@contextlib.contextmanager
def claiming(model: torch.nn.Module, args: Any, device: torch.device
             ) -> Iterator[tuple[Any, dict[int, torch.Tensor]]]:
    """Within the block, `model`'s meta parameters and buffers are fake tensors on `device`;
    yields `args` (any pytree) with each tensor made such a fake, and the table from each
    installed fake's id to the model's own tensor (for `restore_tensors`). The model gets its
    own tensors back on exit, whatever happens inside."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # One mode for the model and the inputs: export reuses the mode it finds on its inputs.
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}  # id(own tensor) -> its fake (a tied weight: one)
    originals: dict[int, torch.Tensor] = {}  # id(fake) -> own tensor

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            made: torch.Tensor = FakeTensor(mode, tensor.detach().to("meta"), device)
            if isinstance(tensor, torch.nn.Parameter):
                made = torch.nn.Parameter(made, requires_grad=tensor.requires_grad)
            elif tensor.requires_grad:
                made.requires_grad_(True)
            fakes[id(tensor)] = made
            originals[id(made)] = tensor
        return fakes[id(tensor)]

    swapped: list[tuple[dict, str, torch.Tensor]] = []
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, tensor in table.items():
                if tensor is not None and tensor.is_meta:
                    swapped.append((table, name, tensor))
                    table[name] = fake(tensor)
    try:
        yield pytree.tree_map(lambda x: fake(x) if isinstance(x, torch.Tensor) else x,
                              args), originals
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


def restore_tensors(captured: CapturedModel, model: torch.nn.Module,
                    originals: dict[int, torch.Tensor], device: torch.device) -> CapturedModel:
    """`captured` (traced with fakes on `device`) with every fake tensor its module holds
    replaced by the model's own meta tensor: by identity where capture kept the fake itself,
    else by its name in the model."""
    from torch._subclasses.fake_tensor import FakeTensor

    own: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    for prefix, module in captured.module.named_modules(remove_duplicate=False):
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers, vars(module))
        for table in tables:
            for name, value in list(table.items()):
                if not isinstance(value, FakeTensor):
                    continue
                key = f"{prefix}.{name}" if prefix else name
                mine = originals.get(id(value), own.get(key))
                if mine is None:
                    raise CaptureError(
                        f"capture of the meta-device model left a fake tensor at {key!r} that "
                        f"is none of the model's parameters or buffers; build the model on a "
                        f"real device, or report this with the model's code")
                table[name] = mine
    return replace(captured, traced_device=device)
