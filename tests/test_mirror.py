"""mirror.py: the model's names over given tensors (the tree a Pipeline registers): the same
objects, in the model's order, a tie once, non-persistent buffers left out of state_dict, and the
model's state-dict hooks on the same paths."""

from __future__ import annotations

import torch

from pipecompile.mirror import copy_state_dict_hooks, mirror


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _entries(model):
    """(name, a copy, persistent) in state_dict order (each module's parameters, then its
    buffers), a tie as one copy under both names."""
    copies, entries = {}, []
    for path, module in model.named_modules():
        own = [*module._parameters.items(), *module._buffers.items()]
        for leaf, tensor in own:
            if tensor is None:  # bias=False
                continue
            if id(tensor) not in copies:
                clone = tensor.detach().clone()
                copies[id(tensor)] = (torch.nn.Parameter(clone)
                                      if isinstance(tensor, torch.nn.Parameter) else clone)
            persistent = leaf not in module._non_persistent_buffers_set
            entries.append((f"{path}.{leaf}" if path else leaf, copies[id(tensor)], persistent))
    return entries


def test_the_tree_holds_the_given_objects_under_the_model_names_in_order():
    model = _Tied()
    entries = _entries(model)
    root = torch.nn.Module()
    mirror(root, entries)
    given = {name: tensor for name, tensor, _ in entries}
    assert [n for n, _ in root.named_parameters()] == [n for n, _ in model.named_parameters()]
    for name, p in root.named_parameters():
        assert p is given[name]
    assert root.head.weight is root.emb.weight  # the tie is one object, listed once
    assert len(list(root.parameters())) == len(list(model.parameters())) == 5
    assert list(root.state_dict()) == list(model.state_dict())  # "scratch" is not persistent
    assert root.scratch is given["scratch"]
    assert root.get_submodule("body.1").running_mean is given["body.1.running_mean"]
    assert isinstance(root.get_submodule("body.1").running_var, torch.Tensor)
    assert not isinstance(root.get_submodule("body.1").running_var, torch.nn.Parameter)


def test_names_that_clash_with_attributes_of_the_root_class_are_fine():
    class Root(torch.nn.Module):
        def step(self):
            return "the method"

    root = Root()
    weight = torch.nn.Parameter(torch.ones(2))
    mirror(root, [("step.weight", weight, True), ("stages.0.bias", torch.zeros(1), True)])
    assert root._modules["step"].weight is weight
    assert root.step() == "the method"  # the class's method still wins attribute lookup
    assert dict(root.named_parameters()) == {"step.weight": weight}
    assert list(root.state_dict()) == ["step.weight", "stages.0.bias"]


def test_state_dict_hooks_are_copied_to_the_same_paths():
    model = _Tied()

    def rename(module, state, prefix, local_metadata):  # a fused weight saved under another key
        state[prefix + "w"] = state.pop(prefix + "weight")

    model.body[0]._register_state_dict_hook(rename)
    root = torch.nn.Module()
    mirror(root, _entries(model))
    assert "body.0.weight" in root.state_dict()
    copy_state_dict_hooks(root, model)
    keys = list(root.state_dict())
    assert keys == list(model.state_dict())
    assert "body.0.w" in keys and "body.0.weight" not in keys
    assert "emb.w" not in keys  # only the module that had the hook renames
