"""runtime/weight_store: linears whose weight gradient waits for W give autograd's gradients
(float64, and under bf16 autocast), and a zero-bubble pipeline runs its stages through them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipecompile as pc
from pipecompile import zoo
from pipecompile.runtime.weight_store import WeightGradStore, collecting, defer_weight_grads


class _Block(nn.Module):
    """Linears with and without bias, one weight used twice (a tie), and one linear whose
    input does not depend on the stage input (its weight gradient stays in I)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.c = nn.Linear(3, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, z):
        h = torch.tanh(self.a(x)) + self.c(z)
        h = self.norm(self.b(torch.relu(self.b(h))))
        return h.sum(-1)


def _graph():
    torch.manual_seed(0)
    block = _Block().double()
    x, z = torch.randn(2, 5, 6, dtype=torch.float64), torch.randn(2, 5, 3, dtype=torch.float64)
    return torch.export.export(block, (x, z)).module(), x, z


def _run(gm, x, z, grad, deferred, exclusive=frozenset()):
    """Input gradient after I, the parameters' .grad after I and after W."""
    leaf = x.detach().requires_grad_(True)
    store = WeightGradStore(exclusive)
    with collecting(store):
        out = (deferred or gm)(leaf, z)
    torch.autograd.backward([out], [grad])
    after_i = {n: None if p.grad is None else p.grad.clone() for n, p in gm.named_parameters()}
    store.flush()
    return leaf.grad, after_i, {n: p.grad.clone() for n, p in gm.named_parameters()}


def test_rewrites_the_linears_on_parameters_only():
    gm, _, _ = _graph()
    deferred = defer_weight_grads(gm)
    targets = [n.target for n in deferred.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.linear.default) == 0
    assert sum(getattr(t, "__name__", "") == "deferred_linear" for t in targets) == 4
    # the same parameter objects: an optimizer over the stage sees one set
    assert [id(p) for p in deferred.parameters()] == [id(p) for p in gm.parameters()]
    conv = torch.export.export(nn.Sequential(nn.Conv1d(2, 2, 3), nn.Flatten(), nn.Linear(16, 2)),
                               (torch.randn(1, 2, 10),)).module()
    assert defer_weight_grads(conv) is None  # convolutions keep the frontier split
    assert defer_weight_grads(torch.export.export(nn.ReLU(), (torch.randn(2),)).module()) is None


def test_input_then_weight_gradients_equal_autograd_and_accumulate():
    gm, x, z = _graph()
    deferred = defer_weight_grads(gm)
    grad = torch.randn(2, 5, dtype=torch.float64)
    want_input, _, want = _run(gm, x, z, grad, None)
    gm.zero_grad(set_to_none=True)
    got_input, after_i, got = _run(gm, x, z, grad, deferred)
    torch.testing.assert_close(got_input, want_input, rtol=1e-14, atol=0)
    # I leaves every deferred linear's weight and bias to W; c's input has no gradient, so
    # its linear stays whole in I, as do the LayerNorm's parameters
    assert {n for n, g in after_i.items() if g is None} == {"a.weight", "a.bias", "b.weight"}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-13, atol=0, msg=name)
    _, _, again = _run(gm, x, z, grad, deferred)  # a second micro-batch adds to .grad
    for name in want:
        torch.testing.assert_close(again[name], 2 * want[name], rtol=1e-13, atol=0, msg=name)
    # parameters no other stage holds: W adds into .grad in place (addmm_), the same sums
    exclusive = frozenset(id(p) for p in gm.parameters())
    before = {n: p.grad for n, p in gm.named_parameters()}
    _, _, fused = _run(gm, x, z, grad, deferred, exclusive)
    assert gm.get_parameter("a.weight").grad is before["a.weight"]  # the same tensor, added to
    for name in want:
        torch.testing.assert_close(fused[name], 3 * want[name], rtol=1e-13, atol=0, msg=name)


def test_bf16_autocast_gives_the_plain_graphs_gradients():
    gm, x, z = _graph()
    gm.float()
    x, z = x.float(), z.float()
    deferred = defer_weight_grads(gm)
    grad = torch.randn(2, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_input, _, want = _run(gm, x, z, grad, None)
        gm.zero_grad(set_to_none=True)
        got_input, _, got = _run(gm, x, z, grad, deferred)
    assert got_input.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got.values())
    torch.testing.assert_close(got_input, want_input, rtol=0, atol=0)
    for name in want:  # the same bf16 kernels: equal, but where a tie's two uses are summed
        # (the plain graph adds them in float32 after the casts' backward; W too, in its order)
        scale = 1e-2 * want[name].abs().max().item() if name == "b.weight" else 0.0
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=scale, msg=name)


def test_without_a_store_the_graph_runs_plain_linears():
    gm, x, z = _graph()
    out = defer_weight_grads(gm)(x.requires_grad_(True), z)  # no `collecting`: eval, infer
    assert out.grad_fn is not None and "Deferred" not in repr(out.grad_fn.next_functions)
    torch.testing.assert_close(out, gm(x, z), rtol=0, atol=0)


@pytest.mark.parametrize("schedule,checkpoint", [("zb-h1", False), ("zb-v", False),
                                                 ("zb-h1", True)])
def test_zero_bubble_stages_split_at_their_linears(schedule, checkpoint):
    """The runtime's zero-bubble stages with stage inputs run deferred linears (I queues their
    work; with recomputation, the recomputed forward does), and the step still equals the
    unsplit model's."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8).double()
    x, y = torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule=schedule,
                      loss_fn=zoo.lm_loss, checkpoint=checkpoint)
    queued = []
    original = WeightGradStore.flush

    def flush(store):
        queued.append(len(store.queued))
        original(store)

    WeightGradStore.flush = flush
    try:
        loss = pipe.step(x, target=y)
    finally:
        WeightGradStore.flush = original
    later_stages = pipe.schedule.num_stages - 1  # the first has no input to differentiate
    assert len(queued) == 2 * later_stages and all(n > 0 for n in queued)
    want = zoo.lm_loss(reference(x), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=0)
    grads = dict(pipe.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-10, atol=1e-13, msg=name)


def test_a_fused_backward_after_a_deferred_forward_runs_the_queued_work():
    """A schedule may mix B with I/W (schedules are data): B of a micro-batch whose forward
    deferred its linears still accumulates every weight gradient."""
    from pipecompile.runtime.stage_worker import StageWorker

    class Tupled(nn.Module):  # a stage graph returns a tuple of its outputs
        def __init__(self):
            super().__init__()
            self.block = _Block()

        def forward(self, x, z):
            return (self.block(x, z),)

    plain, x, z = _graph()
    gm = torch.export.export(Tupled().double(), (x, z)).module()
    gm.load_state_dict({f"block.{n}": t for n, t in plain.state_dict().items()})
    grad = torch.randn(2, 5, dtype=torch.float64)
    want_input, _, want = _run(plain, x, z, grad, None)
    want = {f"block.{n}": g for n, g in want.items()}
    worker = StageWorker(0, gm, ("x", "z"), ("out",), frozenset({"x"}), split_weights=True)
    worker.forward(0, {"x": x, "z": z})
    assert worker.saved[0].store is not None  # the deferred graph ran
    got_input = worker.backward(0, {"out": grad})["x"]
    torch.testing.assert_close(got_input, want_input, rtol=1e-14, atol=0)
    for name, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-13, atol=0, msg=name)


def test_stage_timing_runs_b_on_the_plain_graph_and_i_w_on_the_deferred_one(monkeypatch):
    """measure_stages (profile=True, the planning probe) times B as 1f1b runs it, from the
    plain graph, and I and W as zero-bubble runs them, through the store."""
    from pipecompile.runtime.stage_worker import StageWorker

    plain_b, flushes = [], []
    backward, flush = StageWorker.backward, WeightGradStore.flush

    def timed_backward(self, mb, grads):
        plain_b.append(self.saved[mb].store is None)
        return backward(self, mb, grads)

    monkeypatch.setattr(StageWorker, "backward", timed_backward)
    monkeypatch.setattr(WeightGradStore, "flush", lambda store: flushes.append(1) or flush(store))
    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8)
    x = torch.randint(0, 64, (4, 8))
    pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b", loss_fn=zoo.lm_loss,
               profile=True)
    assert plain_b and all(plain_b)
    assert flushes  # the later stage's W ran the queued work
