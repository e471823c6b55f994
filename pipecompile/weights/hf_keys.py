"""Which checkpoint tensors make each model tensor: transformers' own key conversions, by key.

A `save_pretrained` directory does not always hold the model's state-dict keys: transformers 5
saves a Mixtral's fused experts one by one and renames others (a ViT's `layers.0.attention.q_proj`
is saved as `encoder.layer.0.attention.attention.query`; old BERT checkpoints say
`LayerNorm.gamma`). `from_pretrained` converts them with the model type's conversion mapping
(`transformers.conversion_mapping.get_model_conversion_mapping`: `WeightRenaming`s, then at
most one `WeightConverter` per key, e.g. `MergeModulelist` + `Concatenate`). This module plans
those conversions from the checkpoint's keys alone, so a process reads only the sources of
the tensors it holds, and runs transformers' own converters on them:

    recipes(model, model_keys, stored)  -> Recipes: model key -> Recipe(sources, targets,
                                           converter), and the checkpoint keys nothing uses
    convert(recipe, tensors, model)     -> {model key: tensor} for every target of the recipe

    Mixtral: "model.layers.0.mlp.experts.gate_up_proj" <- Recipe(
        sources=("model.layers.0.block_sparse_moe.experts.0.w1.weight", ...experts.3.w1,
                 "...experts.0.w3.weight", ...), converter=MergeModulelist(0), Concatenate(1))

A model that is not a transformers model, or whose type has no mapping, gets the identity:
each model key the checkpoint holds is its own recipe.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

import torch

from ..errors import CheckpointError

__all__ = ["Recipe", "Recipes", "convert", "recipes", "transforms"]


@dataclass(frozen=True)
class Recipe:
    """Model tensors `targets` made from checkpoint tensors `sources` (in the order transformers
    collects them): copied as they are (`converter` None: one source, one target), or run
    through `converter`, a transformers `WeightConverter` (with `patterns`: the converter's
    source pattern each source matched)."""
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    converter: Any = field(default=None, compare=False)
    patterns: tuple[str, ...] = ()

    def __repr__(self) -> str:
        how = "" if self.converter is None else f" via {type(self.converter).__name__}"
        return f"Recipe({list(self.targets)} <- {list(self.sources)}{how})"


@dataclass(frozen=True)
class Recipes:
    """`by_target`: each model key the checkpoint can fill, with its recipe; `unexpected`: the
    checkpoint keys (after renaming) that fill no model key."""
    by_target: Mapping[str, Recipe]
    unexpected: tuple[str, ...]


def transforms(model: torch.nn.Module | None) -> list[Any]:
    """transformers' weight transforms for `model` (those `from_pretrained` applies), or [] for
    a model that is not a transformers `PreTrainedModel` (transformers is not even imported)."""
    if model is None or "transformers" not in sys.modules:
        return []
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    if not isinstance(model, PreTrainedModel):
        return []
    return list(get_model_conversion_mapping(model))


def recipes(model: torch.nn.Module | None, model_keys: Collection[str],
            stored: Collection[str]) -> Recipes:
    """How each of `model_keys` (all of the model's state-dict keys) is made from the checkpoint
    keys `stored`, as `from_pretrained` would make it (its renaming and converters, its
    `base_model_prefix` added or removed); only keys are read, no tensor."""
    found = transforms(model)
    if not found:
        keys = set(model_keys)
        return Recipes({k: Recipe((k,), (k,)) for k in stored if k in keys},
                       tuple(sorted(k for k in stored if k not in keys)))
    from transformers.core_model_loading import (WeightConverter, WeightRenaming,
                                                 dot_natural_key, rename_source_key)

    renamings = [t for t in found if isinstance(t, WeightRenaming)]
    converters = [t for t in found if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    known: dict[str, bool] = dict.fromkeys(model_keys, True)  # what rename_source_key looks up
    plain: dict[str, str] = {}
    merged: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    unexpected: list[str] = []
    for key in sorted(stored, key=dot_natural_key):  # transformers' order: experts 0, 1, ... 10
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, known)
        if renamed not in known and key in known:  # as from_pretrained: keep a model key
            renamed, pattern = rename_source_key(key, [], [], prefix, known)
        if renamed not in known:
            if pattern is None:
                unexpected.append(renamed)
            else:
                first = by_pattern[pattern].target_patterns[0]
                unexpected.extend(renamed.replace(first, t)
                                  for t in by_pattern[pattern].target_patterns)
        elif pattern is None:
            plain.setdefault(renamed, key)
        else:
            merged.setdefault(renamed, (by_pattern[pattern], []))[1].append((key, pattern))
    by_target: dict[str, Recipe] = {k: Recipe((s,), (k,)) for k, s in plain.items()}
    for first, (converter, members) in merged.items():
        targets = tuple(first.replace(converter.target_patterns[0], t)
                        for t in converter.target_patterns)
        recipe = Recipe(tuple(k for k, _ in members), targets, converter,
                        tuple(p for _, p in members))
        for target in targets:
            if target in known:
                by_target.setdefault(target, recipe)
    return Recipes(by_target, tuple(sorted(unexpected)))


def convert(recipe: Recipe, tensors: Mapping[str, torch.Tensor],
            model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    """The model tensors `recipe` makes from `tensors` (its sources, read): the source itself,
    or what transformers' converter returns for them, under the full model keys."""
    if recipe.converter is None:
        return {recipe.targets[0]: tensors[recipe.sources[0]]}
    converter = copy.deepcopy(recipe.converter)  # it collects tensors: one instance per use
    first = recipe.targets[0]
    for source, pattern in zip(recipe.sources, recipe.patterns):
        converter.add_tensor(first, source, pattern, tensors[source])
    try:
        out = converter.convert(first, model=model, config=getattr(model, "config", None))
    except Exception as exc:  # transformers' ops raise what torch raises
        raise CheckpointError(
            f"transformers' conversion {converter!r} failed to make {list(recipe.targets)} from "
            f"{list(recipe.sources)[:4]}{' ...' if len(recipe.sources) > 4 else ''} "
            f"({type(exc).__name__}: {exc}); is this checkpoint from this model's "
            f"configuration?") from exc
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}
