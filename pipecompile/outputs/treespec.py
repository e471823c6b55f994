"""Pytree specs as text: the captured input/output structures of a saved pipeline.

`torch.utils._pytree.treespec_dumps` writes a spec whose node types have serialized names
(transformers' `ModelOutput`s do). `dump_spec` writes the same JSON layout by hand for types
without one; `load_spec` rebuilds the spec, importing a type's module if needed, and where a type
cannot be rebuilt here puts a plain `dict` (keyed types) or `tuple` in its place, with the same
leaves in the same order.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["dump_spec", "load_spec"]


def dump_spec(spec: pytree.TreeSpec) -> str:
    """`treespec_dumps`, or the same JSON layout written by hand for unregistered types."""
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - a type without a serialized name: describe it
        return json.dumps([1, _spec_json(spec)])


def _spec_json(spec: pytree.TreeSpec) -> dict[str, Any]:
    if spec.is_leaf():
        return {"type": None, "context": None, "children_spec": []}
    try:
        context = json.dumps(list(spec.context) if isinstance(spec.context, (list, tuple))
                             else spec.context)
    except TypeError:
        context = "null"
    return {"type": f"{spec.type.__module__}.{spec.type.__qualname__}", "context": context,
            "children_spec": [_spec_json(c) for c in spec.children_specs]}


def load_spec(text: str, *, import_new: bool = True) -> pytree.TreeSpec:
    """The spec back; types that cannot be rebuilt here become dict (keyed) or tuple. A type's
    module is imported if needed; without `import_new` only where its top-level package is
    already imported (importing runs the module's code: a saved file must not choose it)."""
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001 - perhaps the type's module is not imported yet
        pass
    protocol, root = json.loads(text)
    for type_name in _type_names(root):
        module = type_name.rpartition(".")[0]
        if not import_new and module.partition(".")[0] not in sys.modules:
            continue
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not available here: use the fallback
            continue
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001
        return pytree.tree_flatten(_plain_tree(root))[1]


def _type_names(node: dict[str, Any]) -> set[str]:
    names = {node["type"]} if node["type"] else set()
    for child in node["children_spec"]:
        names |= _type_names(child)
    return names


def _plain_tree(node: dict[str, Any]) -> Any:
    """A structure of tuples, lists and dicts with leaves 0, shaped like the spec `node`."""
    if node["type"] is None:
        return 0
    children = [_plain_tree(c) for c in node["children_spec"]]
    kind = node["type"]
    if kind == "builtins.list":
        return children
    context = json.loads(node["context"]) if node["context"] else None
    if isinstance(context, list) and len(context) == len(children) and all(
        isinstance(k, (str, int)) for k in context
    ):
        return dict(zip(context, children))
    return tuple(children)
