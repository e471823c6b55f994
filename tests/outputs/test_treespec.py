"""treespec.py: pytree specs as text for a saved pipeline; types that cannot be rebuilt come back
as a dict (keyed) or a tuple holding the same leaves in the same order."""

from __future__ import annotations

import json
import warnings

import pytest
from torch.utils import _pytree as pytree

from pipecompile.outputs.treespec import dump_spec, load_spec


class _Pair:  # a pytree node type without a serialized name (as a user's output class)
    def __init__(self, first, second):
        self.first, self.second = first, second


class _Bag:  # a node type whose context is not its children's keys
    def __init__(self, *items):
        self.items = items


pytree.register_pytree_node(_Pair, lambda p: ([p.first, p.second], ["first", "second"]),
                            lambda children, keys: _Pair(*children))
pytree.register_pytree_node(_Bag, lambda b: (list(b.items), len(b.items)),
                            lambda children, n: _Bag(*children))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's children_specs deprecation
        yield


def test_builtin_structures_round_trip_exactly():
    tree = ((1, [2, 3]), {"mask": 4, "ids": (5, None)})
    leaves, spec = pytree.tree_flatten(tree)
    text = dump_spec(spec)
    assert load_spec(text) == spec
    assert pytree.tree_unflatten(leaves, load_spec(text)) == tree


def test_an_unserializable_type_is_written_by_hand_and_read_back_as_a_keyed_dict():
    leaves, spec = pytree.tree_flatten(((1, [2, 3]), {"out": _Pair(4, 5)}))
    with pytest.raises(NotImplementedError):
        pytree.treespec_dumps(spec)  # torch's own writer refuses it
    text = dump_spec(spec)
    _, root = json.loads(text)
    pair = root["children_spec"][1]["children_spec"][0]
    assert pair["type"] == f"{__name__}._Pair"
    assert json.loads(pair["context"]) == ["first", "second"]
    back = load_spec(text)
    assert back.num_leaves == 5
    # the same leaves in the same places, the pair as a dict of its keys
    assert pytree.tree_unflatten(leaves, back) == ((1, [2, 3]), {"out": {"first": 4,
                                                                         "second": 5}})


def test_a_type_without_keys_comes_back_as_a_tuple():
    leaves, spec = pytree.tree_flatten([_Bag(1, 2, 3), 4])
    back = load_spec(dump_spec(spec))
    assert pytree.tree_unflatten(leaves, back) == [(1, 2, 3), 4]
