"""FLOP counting: torch's `FlopCounterMode` with rules for the ops it has none for.

torch 2.13's counter has FLOP rules for the CUDA fused attention kernels (flash, efficient,
cuDNN) but none for the CPU's (`_scaled_dot_product_flash_attention_for_cpu` and its backward),
so on the CPU every attention counted 0 FLOPs: a block's cost, the stage table's FLOPs and
the planner's MFU left attention out where a GPU's counted it. The CPU ops are given torch's
own rules for the fused kernels (the same 4 b h s_q s_k d forward, as `sdpa_flop_count`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["flop_counter", "EXTRA_RULES"]

_aten = torch.ops.aten


def _cpu_attention(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any,
                   out_shape: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape: Any, query_shape: Any, key_shape: Any,
                            value_shape: Any, *args: Any, out_shape: Any = None,
                            **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


#: op -> FLOPs from its arguments' shapes (`FlopCounterMode`'s `custom_mapping`)
EXTRA_RULES = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}


def flop_counter() -> FlopCounterMode:
    """A silent `FlopCounterMode` that also counts the CPU's fused attention."""
    return FlopCounterMode(display=False, custom_mapping=dict(EXTRA_RULES))
