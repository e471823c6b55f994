"""passes/nodes.py: running fx nodes one at a time (what profile and the opaque pass build on)
gives what the graph gives; analysis runs leave buffers as they were."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from pipecompile.ir import nodes


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    def forward(self, x):
        h = self.body(x)  # call_module (fx traces into the Sequential: body.0, body.1)
        h = torch.relu(h)  # call_function
        return h.sum(dim=1)  # call_method


def test_call_node_evaluates_every_op_kind_as_the_graph_does():
    torch.manual_seed(0)
    net = _Net().eval()
    gm = fx.symbolic_trace(net)
    x = torch.randn(5, 4)
    env = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = x
        elif node.op == "output":
            result = env[node.args[0].name]
        else:
            args = fx.node.map_arg(node.args, lambda n: env[n.name])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n.name])
            env[node.name] = nodes.call_node(gm, node, args, kwargs)
    assert {n.op for n in gm.graph.nodes} >= {"call_module", "call_function", "call_method"}
    torch.testing.assert_close(result, gm(x), rtol=0, atol=0)
    torch.testing.assert_close(result, torch.relu(net.body(x)).sum(dim=1), rtol=0, atol=0)
    placeholder = next(iter(gm.graph.nodes))
    with pytest.raises(AssertionError, match="cannot call node x of op placeholder"):
        nodes.call_node(gm, placeholder, (), {})


def test_getattr_path_and_node_target_str_name_nested_attributes():
    net = _Net()
    gm = fx.symbolic_trace(net)
    assert nodes.getattr_path(net, "body.1.running_mean") is net.body[1].running_mean
    assert nodes.getattr_path(net, "body.0") is net.body[0]
    call = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert nodes.node_target_str(call) == "body.0"
    assert nodes.getattr_path(gm, nodes.node_target_str(call)) is net.body[0]
    relu = next(n for n in gm.graph.nodes if n.op == "call_function")
    with pytest.raises(AssertionError, match="has no name as target"):
        nodes.node_target_str(relu)


def test_preserve_buffers_undoes_batch_norm_statistics_even_on_error():
    net = _Net().train()
    bn = net.body[1]
    before = [b.clone() for b in net.buffers()]
    with nodes.preserve_buffers(net):
        net(torch.randn(6, 4) + 3.0)
        assert not torch.equal(bn.running_mean, before[0])  # a training step moved them
    assert all(torch.equal(b, a) for b, a in zip(net.buffers(), before))
    with pytest.raises(RuntimeError, match="boom"), nodes.preserve_buffers(net):
        net(torch.randn(6, 4) + 3.0)
        raise RuntimeError("boom")
    assert all(torch.equal(b, a) for b, a in zip(net.buffers(), before))
    assert int(bn.num_batches_tracked) == 0


def test_recreate_as_call_swaps_one_op_keeping_name_and_meta():
    def f(x, y):
        return torch.add(x, y) * 2

    gm = fx.symbolic_trace(f)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.target is torch.add:
            node.meta["tag"] = "kept"
            # the rewrite: add(x, y) -> sub(x, y), and a prefix argument: max(0.5, ...) below
            new = nodes.recreate_as_call(graph, node, torch.sub, env)
            assert new.name == node.name and new.meta == {"tag": "kept"}
            assert new.meta is not node.meta
            env[node] = new
        elif node.target is operator.mul:
            env[node] = nodes.recreate_as_call(graph, node, _scaled, env, prefix=(0.5,))
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    out = fx.GraphModule(gm, graph)
    x, y = torch.tensor([3.0]), torch.tensor([1.0])
    # (x - y) scaled: 0.5 * (2 * 2) = 2
    torch.testing.assert_close(out(x, y), torch.tensor([2.0]))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.add,
                                                                             operator.mul]


def _scaled(scale, value, factor):
    return scale * value * factor
