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

The model's state-dict hooks are copied onto the same paths, so checkpoint keys are the model's
even where a hook renames them.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["copy_state_dict_hooks", "mirror"]


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


_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def copy_state_dict_hooks(root: torch.nn.Module, model: torch.nn.Module) -> None:
    """Give `root`'s tree the state-dict hooks of `model`'s modules, path by path, so that
    `state_dict()` and `load_state_dict()` speak the model's checkpoint keys (a fused `wqkv`
    saved as `wq`/`wk`/`wv` by its post-hook)."""
    for name, module in model.named_modules():
        if not any(getattr(module, h) for h in _HOOKS):
            continue
        owner = root
        for part in name.split(".") if name else ():
            owner = owner._modules.setdefault(part, torch.nn.Module())  # type: ignore[assignment]
        for hooks in _HOOKS:
            getattr(owner, hooks).update(getattr(module, hooks))
