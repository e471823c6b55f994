"""passes/linearize: blocks follow the module structure; each cut's boundary is what crosses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from pipecompile import zoo
from pipecompile.capture.capture import capture
from pipecompile.errors import ConfigError
from pipecompile.ir.records import NodeRole
from pipecompile.passes.linearize import linearize


class Skip(nn.Module):
    """Four layers; layer 0's output is also read by layer 3, and a mask of the input at the end."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        mask = x > 0  # a function of the input alone
        h0 = self.layers[0](x * 2)  # x * 2: a function of the input too
        h = self.layers[2](torch.relu(self.layers[1](h0)))  # top-level glue between layers
        return self.layers[3](h + h0) * mask


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _skip():
    return capture(Skip(), (torch.randn(8, 4),), {})


def test_skip_connection_crosses_every_cut_up_to_its_reader():
    linear = linearize(_skip())
    assert [b.name for b in linear.blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    # `linear` (block 0's output) is read by block 3: it is live across cuts 1, 2 and 3
    assert linear.boundaries == ((), ("linear",), ("linear", "linear_1"),
                                 ("linear", "linear_2"), ())
    assert [k for k, cut in enumerate(linear.boundaries) if "linear" in cut] == [1, 2, 3]


def test_glue_joins_the_next_block_and_input_functions_are_recomputed():
    linear = linearize(_skip())
    assert linear.blocks[2].nodes == ("relu", "linear_2")  # glue joins the layer after it
    assert linear.blocks[3].nodes == ("add", "linear_3", "mul_1")  # and the last, at the end
    assert linear.roles["gt"] == NodeRole.REMAT  # the mask: made early, read in block 3
    assert linear.roles["mul"] == NodeRole.REMAT  # x * 2, read in block 0
    assert linear.roles["x"] == NodeRole.INPUT
    assert linear.roles["layers_0_weight"] == NodeRole.PARAM
    assert not any({"gt", "mul"} & set(cut) for cut in linear.boundaries)  # never sent
    assert "gt" not in linear.block_of and linear.block_of["linear_2"] == 2


def test_a_value_computed_from_a_trainable_parameter_is_not_recomputed():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x) * (self.scale * 2)  # no input involved, but it needs a gradient

    linear = linearize(capture(Scaled(), (torch.randn(8, 4),), {}))
    doubled = [n for n, role in linear.roles.items() if n.startswith("mul")]
    assert [linear.roles[n] for n in doubled] == [NodeRole.COMPUTE] * 2


def test_granularity_goes_inside_layers():
    captured = capture(Nested(), (torch.randn(8, 4),), {})
    assert [b.name for b in linearize(captured).blocks] == ["layers.0", "layers.1", "head"]
    finer = linearize(captured, granularity="layer+1")
    # the residual adds sit in the layer itself, not in a submodule: blocks of their own
    assert [(b.name, b.nodes) for b in finer.blocks] == [
        ("layers.0.attn", ("linear",)), ("layers.0", ("add",)),
        ("layers.0.mlp", ("linear_1", "relu", "linear_2")), ("layers.0#2", ("add_1",)),
        ("layers.1.attn", ("linear_3",)), ("layers.1", ("add_2",)),
        ("layers.1.mlp", ("linear_4", "relu_1", "linear_5")), ("layers.1#2", ("add_3",)),
        ("head", ("linear_6",))]
    assert finer.granularity == "layer+1"
    ops = linearize(captured, granularity="op")
    compute = [n for n, role in ops.roles.items() if role == NodeRole.COMPUTE]
    assert [b.nodes for b in ops.blocks] == [(n,) for n in compute]
    # every granularity places every compute node in exactly one block, in graph order
    for linear in (linearize(captured), finer, ops):
        assert [n for b in linear.blocks for n in b.nodes] == compute


def test_unknown_granularity_names_the_choices():
    with pytest.raises(ConfigError, match=r"granularity='layer\+9' is unknown; use one of"):
        linearize(_skip(), granularity="layer+9")


def _brute_force_boundaries(linear) -> list[set[str]]:
    """Cut k: compute values made in a block < k and read, directly or through recomputed
    values, by a block >= k (the output counts as the last block)."""
    graph = linear.captured.module.graph
    n = linear.num_blocks

    def reader_blocks(node, seen=()):
        blocks = set()
        for user in node.users:
            role = linear.roles[user.name]
            if role == NodeRole.OUTPUT:
                blocks.add(n - 1)
            elif role == NodeRole.COMPUTE:
                blocks.add(linear.block_of[user.name])
            elif role == NodeRole.REMAT and user.name not in seen:
                blocks |= reader_blocks(user, (*seen, user.name))
        return blocks

    cuts = [set() for _ in range(n + 1)]
    for node in graph.nodes:
        if linear.roles[node.name] != NodeRole.COMPUTE:
            continue
        made = linear.block_of[node.name]
        for k in range(1, n):
            if made < k and any(b >= k for b in reader_blocks(node)):
                cuts[k].add(node.name)
    return cuts


@pytest.mark.parametrize("granularity", ["layer", "op"])
def test_boundaries_equal_a_brute_force_liveness(granularity):
    torch.manual_seed(0)
    model = zoo.UNet(channels=3, width=4, classes=2)
    linear = linearize(capture(model, (torch.randn(2, 3, 8, 8),), {}), granularity=granularity)
    got = [set(cut) for cut in linear.boundaries]
    assert got == _brute_force_boundaries(linear)
    assert max(len(cut) for cut in got) >= 2  # the U-Net's skips make some cuts wider


def test_linearize_leaves_the_captured_graph_unchanged():
    captured = _skip()
    code = captured.module.code
    linearize(captured, granularity="op")
    assert captured.module.code == code
