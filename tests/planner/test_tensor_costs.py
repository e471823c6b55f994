"""Tensor parallelism planned and priced on a cluster of absent devices: T flows from compile
to the layout, the layouts enumerate it inside a node, one rank's share of a block costs 1/T
of its sharded work plus the per-layer all-reduces, and bad degrees say what to pass."""

from __future__ import annotations

import pytest
import sympy
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError
from pipecompile.ir.records import evaluate
from pipecompile.planner.collectives import Group, all_reduce
from pipecompile.planner.layout import (
    Layout,
    data_group,
    describe_placement,
    layouts,
    pipeline_specs,
    tensor_degrees,
    tensor_group,
)
from pipecompile.planner.layout import LayoutCandidate
from pipecompile.planner.tensor_costs import (
    REPLICATED_ACTIVATIONS,
    TensorShare,
    _shard_kernels,
    attention_heads,
    shard_costs,
)

pytestmark = pytest.mark.xdist_group("search-layouts")

C = pc.cluster("h100", nodes=2, per_node=4)


def _gpt(heads=4):
    torch.manual_seed(0)
    return zoo.GPT(vocab=64, dim=64, layers=4, heads=heads, seq=64), torch.randint(0, 64, (8, 64))


@pytest.fixture(scope="module")
def given():
    model, ids = _gpt()
    return pc.compile(model, (ids,), devices=C, data_parallel=2, tensor_parallel=2,
                      optimizer=lambda p: torch.optim.AdamW(p))


@pytest.fixture(scope="module")
def unsplit():
    model, ids = _gpt()
    return pc.compile(model, (ids,), devices=C, data_parallel=8, tensor_parallel=1,
                      schedule="gpipe", microbatches=1, checkpoint=False,
                      optimizer=lambda p: torch.optim.AdamW(p))


def test_a_given_degree_flows_to_the_layout_and_leaves_the_pipeline(given):
    layout = given.layout
    assert (layout.pipeline, layout.data_parallel, layout.tensor_parallel) == (2, 2, 2)
    assert layout.devices == 8 and "x TP2" in str(layout)
    text, explained = str(given), given.explain()
    assert f"layout {layout}" in text and "tensor-parallel groups of 2 on one node" in text
    assert "over 8 devices" in text  # throughput counts P x D x T devices
    assert "tensor_parallel 2" in " ".join(explained.split()) and "P x D x T" in explained
    assert "2 x 2 x 2" in explained
    assert any("tensor parallel 2" in note for note in given.plan.costs.notes)


def test_a_given_degree_on_a_large_cluster_leaves_p_2():
    from pipecompile.planner.layout_options import job_options
    from pipecompile.planner.request import Request

    big = pc.cluster("a100", nodes=64, per_node=8)
    found = layouts(len(big), batch=64, max_pipeline=80, fsdp=False, nodes=64, tensor=(8,))
    assert [(x.pipeline, x.data_parallel) for x in found if x.data_parallel == 32] == [(2, 32)]
    request = Request.of(devices=big, data_parallel=32, tensor_parallel=8)
    options = job_options(None, request)
    assert len(options.devices) == 512 and options.data_parallel == 32


def test_layouts_enumerate_degrees_inside_a_node_and_place_groups_consecutively():
    assert tensor_degrees(8, None) == (8, 4, 2, 1) and tensor_degrees(8, 2) == (2,)
    found = layouts(8, batch=8, max_pipeline=8, fsdp=False, nodes=2, tensor=(4, 2, 1))
    assert Layout(2, 1, tensor_parallel=4) in found and Layout(1, 2, tensor_parallel=4) in found
    assert all(x.devices == 8 for x in found)
    # T = 4 on nodes of 4: one group per node, so one placement only
    assert [x.inner for x in found if x.tensor_parallel == 4 and x.pipeline == 2] == ["pipeline"]
    tp = Layout(2, 2, inner="pipeline", tensor_parallel=2)  # groups {0,1} {2,3} | {4,5} {6,7}
    assert tensor_group(tp, C) == Group(2, 1)
    assert {s.bandwidth for s in pipeline_specs(tp, C, [])} == {C.intra.bandwidth}
    assert data_group(tp, C) == Group(1, 2)  # replica r starts at device 4 r
    assert "tensor-parallel groups of 2 on one node over nvlink" in describe_placement(tp, C)
    candidate = LayoutCandidate(tp, 1.0, "1f1b", 4, 1, 0, 1e9)
    assert LayoutCandidate.from_dict(candidate.to_dict()) == candidate


def test_one_rank_costs_its_share_of_a_layer_plus_two_all_reduces(unsplit):
    costs, rates = unsplit.plan.costs, unsplit.plan.device_model.kernels
    blocks = [b.name for b in unsplit.plan.linear.blocks]
    i = blocks.index("layers.0")
    shapes = {n: tuple(p.shape) for n, p in unsplit.plan.captured.module.named_parameters(
        remove_duplicate=False)}
    share = TensorShare(2, C.intra)
    sharded = shard_costs(costs, share, shapes=shapes, rates=rates, batch_size=1)
    value = lambda e: evaluate(e, costs.sizes)  # noqa: E731
    kernels = costs.symbolic[i].kernels
    whole, _ = kernels.parts(costs.blocks[i].backward_flops, rates, value)
    mine = _shard_kernels(kernels, 2, value, costs.blocks[i].backward_flops, False)
    half, _ = mine.kernels.parts(mine.backward_flops, rates, value)
    assert (mine.narrowest, mine.widest, mine.tokens, mine.unfused) == (64, 256, 64, 0)
    # the sharded parts: matmuls about halve (tiles and launches aside); attention runs half
    # its heads (here one wave of tiles either way: no faster); memory-bound kernels whole
    assert 0.45 * whole.matmul <= half.matmul <= 0.75 * whole.matmul
    assert half.attention <= whole.attention and half.memory <= whole.memory
    # + Megatron's two all-reduces per layer, of b s h bytes (here 64 tokens x 64 x 4 bytes)
    reduce = all_reduce(64 * 64 * 4, Group(2, 1), C.intra, C.intra)
    assert sharded.blocks[i].forward_time == pytest.approx(
        costs.blocks[i].forward_time * half.total / whole.total + 2 * reduce)
    # never dearer than the whole layer plus the reduces (here, at 64 tokens, every kernel is
    # at the 7 us launch floor either way: no cheaper either)
    assert sharded.blocks[i].forward_time <= (costs.blocks[i].forward_time + 2 * reduce) * (
        1 + 1e-12)
    # weights held 1/T (the norms' vectors whole), activations as Korthikanti et al.
    assert sharded.symbolic[i].param_bytes < 0.52 * costs.symbolic[i].param_bytes
    assert sharded.blocks[i].activation_bytes == pytest.approx(
        costs.blocks[i].activation_bytes * (REPLICATED_ACTIVATIONS
                                            + (1 - REPLICATED_ACTIVATIONS) / 2))
    assert sharded.blocks[i].forward_flops == costs.blocks[i].forward_flops  # the model's
    assert shard_costs(costs, TensorShare(1, C.intra), shapes=shapes, rates=rates,
                       batch_size=1) is costs
    assert attention_heads(costs, 1) == (4,)


def test_auto_chooses_tensor_parallelism_where_it_pays():
    """A layer too big for one device with its optimizer state: T > 1 inside a node wins."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = zoo.GPT(vocab=512, dim=4096, layers=2, heads=32, seq=512).to(torch.bfloat16)
    ids = torch.zeros(4, 512, dtype=torch.long, device="meta")
    pipe = pc.compile(model, (ids,), devices=pc.cluster("h100", nodes=1, per_node=4),
                      data_parallel="auto", tensor_parallel="auto", schedule="1f1b",
                      checkpoint=False, memory_limit=2.5e9, microbatches=4,
                      optimizer=lambda p: torch.optim.AdamW(p))
    assert pipe.layout.tensor_parallel > 1
    tried = {c.layout.tensor_parallel for c in pipe.plan.search.layouts}
    assert tried == {1, 2, 4}


def test_a_degree_that_does_not_divide_the_node_or_the_heads_is_refused():
    model, ids = _gpt(heads=4)
    with pytest.raises(ConfigError, match=r"tensor_parallel=3 does not divide the 4 GPUs per "
                                          r"node"):
        pc.compile(model, (ids,), devices=C, data_parallel="auto", tensor_parallel=3)
    with pytest.raises(ConfigError, match=r"data_parallel=4 x tensor_parallel=4 does not "
                                          r"divide the 8 GPUs"):
        pc.compile(model, (ids,), devices=C, data_parallel=4, tensor_parallel=4)
    with pytest.raises(ConfigError, match=r"tensor_parallel=4 does not divide the 2 attention "
                                          r"heads"):
        heads2, _ = _gpt(heads=2)
        pc.compile(heads2, (ids,), devices=C, data_parallel="auto", tensor_parallel=4)
    # a given T on this machine's devices runs under torchrun only (the runtime's path)
    with pytest.raises(ConfigError, match="launch devices=2 x data_parallel=1 x "
                                          "tensor_parallel=2 = 4 ranks with torchrun"):
        pc.compile(model, (ids,), devices=2, tensor_parallel=2)


def test_a_saved_plan_keeps_its_degree(given, tmp_path):
    given.save(tmp_path)
    back = pc.load(tmp_path, loss_fn=zoo.lm_loss)
    assert back.layout == given.layout and back.layout.tensor_parallel == 2
    assert f"layout {given.layout}" in str(back)


class _EagerLayer(torch.nn.Module):
    """Attention written out as matmuls (QK^T, softmax, by V), then an MLP of 4 x width."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), \
            torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        att = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.relu(self.up(x)))


def test_attention_written_as_matmuls_is_split_by_heads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_EagerLayer(), _EagerLayer())
    pipe = pc.compile(model, (torch.randn(8, 16, 64),), devices=C, data_parallel=8,
                      schedule="gpipe", microbatches=1, checkpoint=False)
    costs, rates = pipe.plan.costs, pipe.plan.device_model.kernels
    value = lambda e: evaluate(e, costs.sizes)  # noqa: E731
    block = next(i for i, c in enumerate(costs.symbolic) if c.kernels.gemms)
    mine = _shard_kernels(costs.symbolic[block].kernels, 2, value,
                          costs.blocks[block].backward_flops, False)
    assert mine.unfused == 1 and mine.narrowest == 64 and mine.widest == 256
    batched = [g for g in mine.kernels.gemms if value(g[3]) > 1]
    # QK^T and by V (one record of count 2 here: s = d = 16), 1 sample x 4 heads / 2 each
    assert [(value(g[3]), g[5]) for g in batched] == [(2.0, 2)]
    shapes = {n: tuple(p.shape) for n, p in pipe.plan.captured.module.named_parameters()}
    sharded = shard_costs(costs, TensorShare(2, C.intra), shapes=shapes, rates=rates,
                          batch_size=1)
    reduce = all_reduce(16 * 64 * 4, Group(2, 1), C.intra, C.intra)  # b s h float32
    whole, _ = costs.symbolic[block].kernels.times(costs.blocks[block].backward_flops, rates,
                                                   value)
    half, _ = mine.kernels.times(mine.backward_flops, rates, value)
    assert sharded.blocks[block].forward_time == pytest.approx(
        costs.blocks[block].forward_time * half / whole + 2 * reduce)


def test_a_kernel_with_its_own_backward_is_split_as_its_move():
    """A loss over the vocabulary (`Kernels.ruled`: forward and backward bytes of its own) is
    split over T exactly where its memory-bound move is, so one rank's backward is the
    kernel's own backward over T, not twice its forward."""
    from pipecompile.passes.kernels import Kernels

    tokens, width, vocab = 64.0, 32, 128
    gemm = (sympy.Integer(64), sympy.Integer(vocab), sympy.Integer(width), sympy.Integer(1), 2, 1)
    loss = sympy.Integer(int(tokens) * vocab * 16)  # bytes per row: a multiple of the vocabulary
    k = Kernels(gemms=(gemm,), moves=((loss, 1),), ruled=((loss, loss * 20 / 16, 1),),
                memory=loss, launches=2)
    mine = _shard_kernels(k, 2, float, 0.0, False).kernels
    assert mine.moves == ((loss / 2, 1),)
    assert mine.ruled == ((loss / 2, loss * 20 / 32, 1),)


def _vocabulary(vocab, hidden, roles, T, tokens=8192, given=None):
    from pipecompile.ir.shard_plan import VocabularyLayer
    from pipecompile.planner.tensor_costs import TensorShare, vocabulary_price

    h100 = pc.preset("h100")
    share = TensorShare(T, pc.cluster("h100", nodes=1, per_node=8).intra, memory=h100.memory)
    return vocabulary_price(VocabularyLayer("table", vocab, hidden, roles, tokens, 2), share,
                            flops=h100.rate("bfloat16"), optimizer_factor=2.0, given=given)


def test_llama3_70b_splits_its_vocabulary_and_a_tiny_table_stays_whole():
    """Llama-3-70B (128256 x 8192, bf16, AdamW, 8192 tokens, TP8 over NVLink): the output
    layer is faster split (1/8 of its GEMM + the logits' all-gather), the embedding is slower
    split (an all-reduce) but frees ~7 GiB a rank (weight, gradient, AdamW's two moments).
    A 64 x 16 table stays whole: nothing worth it; GPT-2's (50304 x 768, TP2) goes by the
    price, a few percent either way."""
    output = _vocabulary(128256, 8192, ("output",), 8)
    assert output.chosen and output.split < output.whole / 4
    embedding = _vocabulary(128256, 8192, ("embedding",), 8)
    assert embedding.chosen and embedding.split > embedding.whole
    assert abs(embedding.freed - 128256 * 8192 * 2 * 4 * 7 / 8) < 1
    assert "split over 8 (frees >= 1% of the device's memory)" in str(embedding)
    tied = _vocabulary(64, 16, ("embedding", "output"), 2)
    assert not tied.chosen and "replicated (cheaper whole)" in str(tied)
    # GPT-2's tied 50304 x 768 at TP2: within a few percent either way, split where no slower
    gpt2 = _vocabulary(50304, 768, ("embedding", "output"), 2)
    assert abs(gpt2.split / gpt2.whole - 1) < 0.1 and gpt2.chosen == (gpt2.split <= gpt2.whole)


def test_vocab_parallel_given_overrides_the_price():
    assert _vocabulary(64, 16, ("embedding",), 2, given=True).chosen
    assert not _vocabulary(128256, 8192, ("output",), 8, given=False).chosen
    assert "vocab_parallel=True" in str(_vocabulary(64, 16, ("output",), 2, given=True))


def test_a_table_priced_whole_keeps_its_bytes_on_every_rank():
    """shard_costs with the vocabulary's choice: a table kept whole holds all its bytes on
    each rank, one split holds 1/T."""
    from types import SimpleNamespace

    from pipecompile.planner.cluster import Link

    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=1, heads=2, seq=8)
    pipe = pc.compile(model, (torch.zeros(2, 8, dtype=torch.long),), devices=["cpu"],
                      loss_fn=zoo.lm_loss, microbatches=1, schedule="gpipe")
    costs = pipe.plan.costs
    shapes = {n: tuple(p.shape) for n, p in pipe.plan.captured.module.named_parameters(
        remove_duplicate=False)}
    share = TensorShare(2, Link("link", 1e9, 0.0))
    held = {}
    for chosen in (True, False):
        price = SimpleNamespace(chosen=chosen, layer=SimpleNamespace(
            vocab=64, hidden=16, roles=("embedding", "output")))
        table = shard_costs(costs, share, shapes=shapes, rates=None, batch_size=2,
                            vocabulary={"lm_head.weight": price})
        held[chosen] = sum(c.param_bytes for c in table.symbolic)
    whole = sum(c.param_bytes for c in costs.symbolic)
    holders = sum("lm_head.weight" in c.parameters for c in costs.symbolic)  # both ends
    assert holders >= 1
    assert held[False] - held[True] == holders * 64 * 16 * 4 // 2  # half the float32 table
    assert held[False] < whole
