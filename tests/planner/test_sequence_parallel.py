"""Sequence parallelism planned and priced on a cluster of absent devices, and the kernels on
an attention's heads priced 1/T: `sequence_parallel=` is checked once (a bool or "auto"; True
needs T > 1; it runs under torchrun, not with FSDP or an asynchronous schedule), flows to the layout, its text, explain() and a saved plan, and
"auto" keeps it where it is faster; rotary embeddings on the sharded queries and keys run on
heads / T of them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError
from pipecompile.ir.records import evaluate
from pipecompile.planner.layout import Layout, layouts, sequence_choices
from pipecompile.planner.layout import LayoutCandidate
from pipecompile.planner.request import Request
from pipecompile.planner.tensor_costs import TensorShare, _shard_kernels, shard_costs

pytestmark = pytest.mark.xdist_group("search-layouts")

C = pc.cluster("h100", nodes=2, per_node=4)


def _gpt():
    torch.manual_seed(0)
    return zoo.GPT(vocab=64, dim=64, layers=4, heads=4, seq=64), torch.randint(0, 64, (8, 64))


def test_the_option_is_a_bool_or_auto_and_needs_tensor_parallelism():
    with pytest.raises(ConfigError, match="sequence_parallel must be True, False or 'auto'"):
        Request.of(sequence_parallel="yes")
    with pytest.raises(ConfigError, match="tensor_parallel=1 has none; pass tensor_parallel"):
        Request.of(devices=C, tensor_parallel=1, sequence_parallel=True)
    assert Request.of(tensor_parallel="auto", sequence_parallel=True).layout.sequence_parallel
    assert Request.of(sequence_parallel="auto").layout.sequence_parallel == "auto"
    model, ids = _gpt()
    # it runs under torchrun (tests/distributed/test_tensor_parallel_exact.py), one rank per
    # shard: in one process it is refused as tensor_parallel=2 is
    with pytest.raises(ConfigError, match="tensor_parallel=2 runs one rank per shard: launch"):
        pc.compile(model, (ids,), devices=2, tensor_parallel=2, sequence_parallel=True)


@pytest.mark.parametrize("what", [{"schedule": "pipedream"}, {"compile_stages": True}])
def test_what_sequence_parallelism_does_not_run_with_is_refused_naming_it(what):
    from pipecompile.ir.devices import DeviceSpec
    from pipecompile.planner.options import CompileOptions, _check_tensor_parallel

    options = CompileOptions(**{"devices": (DeviceSpec(),), "microbatches": 2,
                                "schedule": "1f1b", "tensor_parallel": 2,
                                "sequence_parallel": True, **what})
    (name,) = what
    with pytest.raises(ConfigError, match=f"tensor_parallel=2, sequence_parallel=True with "
                                          f"{name}=.* is not built yet.*leave out {name}"):
        _check_tensor_parallel(options)
    # FSDP and recomputation run with it (tests/distributed/test_tensor_parallel_fsdp.py)
    for runs in ({"fsdp": True}, {"checkpoint": True}):
        _check_tensor_parallel(replace(options, schedule="1f1b", compile_stages=False, **runs))


def test_layouts_try_both_settings_for_t_above_one():
    assert sequence_choices("auto") == (False, True) and sequence_choices(True) == (True,)
    assert sequence_choices(False) == (False,)
    found = layouts(8, batch=8, max_pipeline=8, fsdp=False, nodes=2, tensor=(4, 1),
                    sequence=(False, True))
    assert {x.sequence_parallel for x in found if x.tensor_parallel == 1} == {False}
    four = [x for x in found if x.tensor_parallel == 4]
    assert len([x for x in four if x.sequence_parallel]) == len(four) // 2 > 0
    lay = Layout(2, 1, tensor_parallel=4, sequence_parallel=True)
    assert "x TP4+SP" in str(lay)
    candidate = LayoutCandidate(lay, 1.0, "1f1b", 4, 1, 0, 1e9)
    assert LayoutCandidate.from_dict(candidate.to_dict()) == candidate


@pytest.fixture(scope="module")
def given():
    model, ids = _gpt()
    return pc.compile(model, (ids,), devices=C, data_parallel=2, tensor_parallel=2,
                      sequence_parallel=True, optimizer=lambda p: torch.optim.AdamW(p))


def test_a_given_setting_is_priced_shown_and_saved(given, tmp_path):
    layout = given.layout
    assert layout.tensor_parallel == 2 and layout.sequence_parallel
    assert "x TP2+SP" in str(layout) and f"layout {layout}" in str(given)
    explained = " ".join(given.explain().split())
    assert "tensor_parallel 2, sequence_parallel=True 2 + sequence parallel" in explained
    assert "2 x 2 x 2+SP" in explained
    assert any("sequence parallel" in note for note in given.plan.costs.notes)
    given.save(tmp_path)
    back = pc.load(tmp_path, loss_fn=zoo.lm_loss)
    assert back.layout == layout and back.layout.sequence_parallel


def test_sequence_parallelism_splits_memory_bound_kernels_and_activations():
    model, ids = _gpt()
    pipe = pc.compile(model, (ids,), devices=C, data_parallel=8, schedule="gpipe",
                      microbatches=1, checkpoint=False)
    costs, rates = pipe.plan.costs, pipe.plan.device_model.kernels
    shapes = {n: tuple(p.shape) for n, p in pipe.plan.captured.module.named_parameters(
        remove_duplicate=False)}
    plain, split = (shard_costs(costs, TensorShare(2, C.intra, sp), shapes=shapes, rates=rates,
                                batch_size=1) for sp in (False, True))
    layer = [b.name for b in pipe.plan.linear.blocks].index("layers.0")
    assert split.blocks[layer].activation_bytes == pytest.approx(
        costs.blocks[layer].activation_bytes / 2)
    assert split.blocks[layer].activation_bytes < plain.blocks[layer].activation_bytes
    assert split.blocks[layer].forward_time <= plain.blocks[layer].forward_time
    assert split.blocks[layer].static_bytes == plain.blocks[layer].static_bytes


def test_auto_keeps_sequence_parallelism_where_it_is_faster():
    """Wide layers on meta: the norms and residuals on 1/T of the tokens are faster, so the
    search keeps the sequence-parallel twin of the chosen layout; both were tried."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = zoo.GPT(vocab=512, dim=2048, layers=2, heads=16, seq=1024).to(torch.bfloat16)
    ids = torch.zeros(4, 1024, dtype=torch.long, device="meta")
    pipe = pc.compile(model, (ids,), devices=pc.cluster("h100", nodes=1, per_node=4),
                      data_parallel=1, tensor_parallel=4, sequence_parallel="auto",
                      schedule="1f1b", checkpoint=False, microbatches=4,
                      optimizer=lambda p: torch.optim.AdamW(p))
    tried = {c.layout.sequence_parallel: c for c in pipe.plan.search.layouts
             if c.layout.pipeline == pipe.layout.pipeline}
    assert set(tried) == {False, True}
    assert tried[True].step < tried[False].step * (1 - 1e-3)
    assert pipe.layout.sequence_parallel and "TP4+SP" in str(pipe.layout)
    assert "+SP" in pipe.explain()


class _RotaryLayer(torch.nn.Module):
    """A Llama-style layer: q, k, v projections, rotary embeddings on (b, heads, s, d),
    fused attention, an output projection, and an MLP of 5 x width (no kernel's bytes per
    token a multiple of it: the MLP's rule leaves the others whole)."""

    def __init__(self, dim: int = 64, heads: int = 4, seq: int = 16):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False)
                                          for _ in range(4))
        self.up, self.down = torch.nn.Linear(dim, 5 * dim), torch.nn.Linear(5 * dim, dim)
        d = dim // heads
        angle = torch.arange(seq)[:, None] / 10000 ** (torch.arange(0, d, 2) / d)
        self.register_buffer("cos", torch.cat([angle.cos()] * 2, -1), persistent=False)
        self.register_buffer("sin", torch.cat([angle.sin()] * 2, -1), persistent=False)

    def _rotary(self, x):
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat([-x[..., half:], x[..., :half]], -1) * self.sin

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(self._rotary(q), self._rotary(k), v,
                                             is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(torch.relu(self.up(x)))


def test_rotary_embeddings_on_the_sharded_heads_run_one_t_th():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_RotaryLayer(), _RotaryLayer())
    pipe = pc.compile(model, (torch.randn(8, 16, 64),), devices=C, data_parallel=8,
                      schedule="gpipe", microbatches=1, checkpoint=False)
    costs = pipe.plan.costs
    value = lambda e: evaluate(e, costs.sizes)  # noqa: E731
    block = next(i for i, c in enumerate(costs.symbolic) if c.kernels.flash)
    kernels = costs.symbolic[block].kernels
    # one sample: q and k of (1, 4 heads, 16, 16) float32: rotary's mul, neg, cat, mul and
    # add on each (its slices are views), each output 4 heads per token
    assert all(value(rows) == 4 * 16 for _, rows, _ in kernels.split)
    assert sum(n for *_, n in kernels.split) >= 2 * 5
    mine = _shard_kernels(kernels, 2, value, costs.blocks[block].backward_flops, False)
    split_bytes = sum(value(b) * n for b, _, n in kernels.split)
    plain = replace(kernels, split=())  # what was priced before: every such kernel whole
    before = _shard_kernels(plain, 2, value, costs.blocks[block].backward_flops, False)
    assert value(mine.kernels.memory) == pytest.approx(
        value(before.kernels.memory) - split_bytes / 2)
    # the two residual adds over (1, 16, 64) stay whole; rotary's adds of as many bytes (two
    # q-sized reads, one write) are on the heads: counted apart though their bytes are equal
    residual = 3 * 16 * 64 * 4
    on_heads = sum(n for b, _, n in kernels.split if value(b) == residual)
    assert on_heads == 2
    assert {(value(b), n) for b, n in mine.kernels.moves} >= {(residual, 2),
                                                              (residual / 2, on_heads)}
    assert math.isclose(sum(value(b) * n for b, n in mine.kernels.moves),
                        value(mine.kernels.memory))
