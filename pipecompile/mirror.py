"""The model's names over this process's tensors: the module tree a `Pipeline` registers.

A `Pipeline` is an `nn.Module` whose parameters and buffers are the original model's, under
the original names, in the original order, but holding the copies this process's stages use.
`mirror` builds that tree: one plain `nn.Module` per module path of the model, each holding the
stage tensors under their original attribute names. A tied weight (`wte.weight` =
`lm_head.weight`) is one object under both names, as in the model, so `named_parameters()`
lists it once and `state_dict()` under both keys. The stage GraphModules are not in the tree:
nothing is registered twice or under a stage prefix.

    model.transformer.h[0].attn.c_attn.weight     (user's model)
    stage0.module.transformer.h.0.attn.c_attn.weight  (the same tensor on a CPU stage)
    pipe.transformer.h.0.attn.c_attn.weight       (registered here: that same object)
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["mirror"]


def mirror(root: torch.nn.Module,
           entries: Iterable[tuple[str, torch.Tensor, bool]]) -> None:
    """Register each (dotted name, tensor, persistent) under `root`, creating module paths in
    the order they first appear: given state_dict order, the tree's traversal order (and so
    `named_parameters()` and `state_dict()` order) is the model's.

    Entries go straight into the module dictionaries, so a model's names never clash with
    attributes of `root`'s class (a module called `stages` or `step` is fine)."""
    for name, tensor, persistent in entries:
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            child = owner._modules.get(part)
            if child is None:
                child = owner._modules[part] = torch.nn.Module()
            owner = child
        if isinstance(tensor, torch.nn.Parameter):
            owner._parameters[leaf] = tensor
        else:
            owner._buffers[leaf] = tensor
            if not persistent:
                owner._non_persistent_buffers_set.add(leaf)
