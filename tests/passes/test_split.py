"""passes/split: one graph module per stage, wired by value names, with the model's parameter names."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from pipecompile.capture.capture import capture
from pipecompile.errors import ConfigError
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import block_wiring, split
from tests.passes.test_linearize import Skip


class Tied(nn.Module):
    """An embedding whose weight is also the output layer's, and a skip from it to layer 1."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h0 = self.emb(ids)
        h = self.layers[1](torch.relu(self.layers[0](h0)))
        return self.head(h + h0)


def _tied(devices=("cpu",) * 3):
    """The tied model split as emb | layers.0 | layers.1 + head."""
    torch.manual_seed(0)
    model = Tied().double()
    ids = torch.randint(0, 10, (8, 3))
    linear = linearize(capture(model, (ids,), {}))
    assert [b.name for b in linear.blocks] == ["emb", "layers.0", "layers.1", "head"]
    return model, ids, split(linear, (0, 1, 2, 4), list(devices))


def _run(program, inputs: dict) -> tuple:
    """Feed the stages in order, each from the values produced so far, as the manifest says."""
    env = dict(inputs)
    for stage in program.stages:
        env.update(zip(stage.outputs, stage.module(*[env[n] for n in stage.inputs])))
    return tuple(env[n] for n in program.stages[-1].outputs)


def test_stage_inputs_and_outputs_are_named_by_value():
    _, _, program = _tied()
    assert [(s.inputs, s.outputs) for s in program.stages] == [
        (("ids",), ("embedding",)),
        (("embedding",), ("linear",)),
        (("embedding", "linear"), ("linear_2",)),  # the skip comes straight from stage 0
    ]
    assert program.producer == {"embedding": 0, "linear": 1}
    assert program.consumers == {"embedding": (1, 2), "linear": (2,)}
    # a placeholder per input, named after the value it receives
    for stage in program.stages:
        placeholders = [n.name for n in stage.module.graph.find_nodes(op="placeholder")]
        assert tuple(placeholders) == stage.inputs
    assert [s.blocks for s in program.stages] == [(0,), (1,), (2, 3)]


def test_the_block_wiring_gives_every_cut_its_producers_and_consumers():
    """One record per linear graph (the search prices every cut's messages with it): which
    block computes each value and which blocks read it; a cut maps those to stages."""
    _, _, program = _tied()
    wiring = block_wiring(program.linear)
    # the embedding is read by layers.0 and by the skip's add in the head's block
    assert dict(wiring.readers) == {"embedding": (1, 3), "linear": (2,), "linear_1": (3,)}
    assert wiring.at(program.bounds) == (program.producer, program.consumers)
    assert wiring.at((0, 3, 4)) == ({"embedding": 0, "linear_1": 0}, {"embedding": (1,),
                                                                       "linear_1": (1,)})
    assert wiring.at((0, 4)) == ({}, {})


def test_stages_in_order_compute_the_model_and_its_gradients():
    model, ids, program = _tied()
    (out,) = _run(program, {"ids": ids})
    want = model(ids)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # each stage's leaf gets its own part; the parts of the tied weight (stage 0's and stage
    # 2's alias) summed are the model's gradient, in which autograd summed both uses
    names = dict(model.named_parameters(remove_duplicate=False))
    want_grads = dict(zip(names, torch.autograd.grad(want.pow(2).sum(), list(names.values()))))
    leaves = [(n, p) for s in program.stages for n, p in s.module.named_parameters()]
    got: dict[str, torch.Tensor] = {}
    for (name, _), g in zip(leaves, torch.autograd.grad(out.pow(2).sum(),
                                                         [p for _, p in leaves])):
        got[name] = got[name] + g if name in got else g
    assert sorted(got) == ["head.weight", "layers.0.bias", "layers.0.weight",
                           "layers.1.bias", "layers.1.weight"]
    for name, g in got.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-14, atol=0)


def test_original_parameter_names_in_each_stage():
    model, _, program = _tied()
    assert [s.parameter_names for s in program.stages] == [
        ("head.weight",),  # export reads the tied weight under one of its names
        ("layers.0.weight", "layers.0.bias"),
        ("head.weight", "layers.1.weight", "layers.1.bias"),
    ]
    params = dict(model.named_parameters(remove_duplicate=False))
    # on the CPU the first stage to read a parameter holds the model's tensor; a later one
    # holds an alias of it (its own leaf, so its own gradient, over the same memory)
    first = program.stages[0].module.get_parameter("head.weight")
    later = program.stages[2].module.get_parameter("head.weight")
    assert first is params["head.weight"] and later is not first
    assert later.data_ptr() == first.data_ptr() and later.requires_grad
    for stage in program.stages[1:]:
        for name in stage.parameter_names:
            if name != "head.weight":
                assert stage.module.get_parameter(name) is params[name]
    assert set(program.tensors) == set(params)


def test_one_parameter_used_by_two_stages_is_a_tie():
    _, _, program = _tied()
    (tie,) = program.ties
    assert tie.names == ("emb.weight", "head.weight")
    assert tie.copies == ((0, "head.weight"), (2, "head.weight"))
    first, last = program.tensors["emb.weight"]
    assert (first[0], last[0]) == (0, 2) and first[1] is not last[1]  # a leaf per stage,
    assert first[1].data_ptr() == last[1].data_ptr()  # one memory on one device

    model, _, apart = _tied(devices=("cpu", "cpu", "meta"))
    (tie,) = apart.ties
    assert tie.copies == ((0, "head.weight"), (2, "head.weight"))
    (s0, t0), (s2, t2) = apart.tensors["head.weight"]
    assert (s0, s2) == (0, 2) and t0 is model.emb.weight
    assert t2 is not t0 and t2.device.type == "meta" and isinstance(t2, nn.Parameter)
    assert apart.stages[2].module.get_parameter("head.weight") is t2


class Reused(nn.Module):
    """One name read at both ends: the encoder's weight decodes, transposed."""

    def __init__(self):
        super().__init__()
        self.encode = nn.Linear(6, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.mid(self.encode(x))) @ self.encode.weight


def test_one_name_read_by_two_stages_is_a_tie_whose_copies_are_summed():
    """Without the tie each rank would step its copy with its own part of the gradient
    (a rank test: tests/runtime/test_distributed.py, keyword_tuple)."""
    torch.manual_seed(0)
    model = Reused().double()
    linear = linearize(capture(model, (torch.randn(8, 6, dtype=torch.float64),), {}))
    n = len(linear.blocks)
    for devices in (("cpu", "cpu"), ("cpu", "meta")):
        program = split(linear, (0, 1, n), list(devices))
        ties = [t for t in program.ties if t.names == ("encode.weight",)]
        assert [t.copies for t in ties] == [((0, "encode.weight"), (1, "encode.weight"))]
        (_, first), (_, last) = program.tensors["encode.weight"]
        assert first is not last and last.requires_grad  # each stage's own leaf
        assert (first.data_ptr() == last.data_ptr()) == (devices[1] == "cpu")  # one memory
    one_stage = split(linear, (0, n), ["cpu"])
    assert one_stage.ties == ()  # one stage, one name: nothing to sum


def test_input_functions_are_recomputed_in_the_stage_that_reads_them():
    torch.manual_seed(0)
    model = Skip().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    linear = linearize(capture(model, (x,), {}))
    program = split(linear, (0, 2, 4), ["cpu", "cpu"])
    last = program.stages[1]
    assert last.inputs == ("x", "linear", "linear_1")  # the mask is not sent
    assert "gt" in {n.name for n in last.module.graph.nodes}
    torch.testing.assert_close(_run(program, {"x": x})[0], model(x), rtol=0, atol=0)


def test_bad_bounds_and_devices_are_named():
    model = Skip()
    linear = linearize(capture(model, (torch.randn(8, 4),), {}))
    with pytest.raises(ConfigError, match=r"stage bounds \(0, 2, 2, 4\) must rise strictly"):
        split(linear, (0, 2, 2, 4), ["cpu"] * 3)
    with pytest.raises(ConfigError, match=r"must rise strictly from 0 to 4"):
        split(linear, (0, 3), ["cpu"])
    with pytest.raises(ConfigError, match="2 stages need 2 devices, got 3"):
        split(linear, (0, 2, 4), ["cpu"] * 3)


def test_split_leaves_its_input_unchanged():
    _, ids, _ = _tied()
    model = Tied()
    captured = capture(model, (ids,), {})
    linear = linearize(captured)
    code = captured.module.code
    blocks, boundaries = linear.blocks, linear.boundaries
    split(linear, (0, 2, 4), ["cpu", "cpu"])
    assert captured.module.code == code
    assert (linear.blocks, linear.boundaries) == (blocks, boundaries)


def test_a_shared_tensor_is_owned_by_its_first_stage():
    """One rule of ownership: the first stage holding a tensor owns it; a process's copies
    are listed owner (or the copy its others follow) first."""
    from pipecompile.ir.records import StagedProgram

    a, b, c = torch.zeros(1), torch.zeros(1), torch.zeros(1)

    class Program:
        tensors = {"w": ((1, a), (2, b), (3, b)), "unused": ((-1, c),)}
        owner_stage = StagedProgram.owner_stage
        held, held_copies = StagedProgram.held, StagedProgram.held_copies

    program = Program()
    assert program.owner_stage("w") == 1 and program.owner_stage("unused") == 0
    assert program.held("w", {2, 3}) == [(2, b), (3, b)]
    assert program.held_copies("w", {1, 2, 3}) == [a, b]
    assert program.held_copies("w", {3}) == [b]
    assert program.held_copies("unused", {0}) == [c]
    assert program.held_copies("unused", {1}) == []


def test_the_passes_folder_names_each_of_its_modules():
    import pipecompile.passes as folder

    from tests.support.folders import unlisted

    assert unlisted(folder) == []
