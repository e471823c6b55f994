"""passes/tensor_shard: the placements chosen from captured stage graphs, and the lowered
graphs of T ranks (run in T threads with an in-memory all-reduce) computing the unsplit
graph's outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile.passes.tensor_shard import choose
from tests.distributed.tensor_parallel_cases import MODELS
from tests.support.thread_ranks import run_lowered


def _stage(model, args, loss_fn):
    pipe = pc.compile(model, example_inputs=args, devices=["cpu"], loss_fn=loss_fn,
                      microbatches=2)
    return pipe.stages[0].module


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ("gpt", "llama", "gpt2"):
        model, args, _, _, loss_fn = MODELS[name]()
        out[name] = (_stage(model, args, loss_fn), args)
    return out


def _unsplit(local, placement, T):
    """The whole gradient from the ranks' slices (each fused part reassembled)."""
    pieces = [g.split([p // T for p in placement.parts], placement.dim) for g in local]
    return torch.cat([torch.cat([pieces[r][i] for r in range(T)], placement.dim)
                      for i in range(len(placement.parts))], placement.dim)


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2"])
def test_lowered_ranks_compute_the_unsplit_graph(graphs, name):
    gm, args = graphs[name]
    plan = choose(gm, 2)
    assert plan.rows, plan.summary()
    want_gm = copy.deepcopy(gm)
    want = want_gm(*args)
    sum(o.sum() for o in want if o.is_floating_point()).backward()
    ranks, _ = run_lowered(gm, plan, args)
    for outs, _ in ranks:
        for got, ref in zip(outs, want):
            assert (got - ref).abs().max().item() <= 1e-12 * max(ref.abs().max().item(), 1)
    _assert_gradients_match(want_gm, plan, ranks)


def _assert_gradients_match(want_gm, plan, ranks) -> None:
    """Each parameter's gradient on the ranks, split ones put back together, against the
    unsplit graph's (1e-10 of its largest); a replicated one identical on both ranks."""
    for pname, param in want_gm.named_parameters():
        if param.grad is None:
            continue
        if pname in plan.params:
            got = _unsplit([g[pname] for _, g in ranks], plan.params[pname], 2)
        else:
            got = ranks[0][1][pname]
            assert torch.equal(got, ranks[1][1][pname]), pname  # replicated: identical
        scale = param.grad.abs().max().item() or 1.0
        assert (got - param.grad).abs().max().item() <= 1e-10 * scale, pname


def test_gpt_placements_column_row_pairs_and_fused_qkv(graphs):
    plan = choose(graphs["gpt"][0], 2)
    p = plan.params
    assert (p["layers.0.attn.qkv.weight"].dim, p["layers.0.attn.qkv.weight"].parts) == \
        (0, (16, 16, 16))  # q, k and v split each, not the concatenation
    assert p["layers.0.attn.proj.weight"].dim == 1 and p["layers.0.mlp.fc.weight"].dim == 0
    assert p["layers.0.mlp.proj.weight"].role == "row"
    assert "layers.0.attn.proj.bias" not in p  # a row's bias is added once, after the reduce
    assert not any(n.startswith(("wte", "wpe", "lm_head", "ln_f")) for n in p)


def test_gpt2_conv1d_splits_its_output_features(graphs):
    p = choose(graphs["gpt2"][0], 2).params
    attn = p["transformer.h.0.attn.c_attn.weight"]  # Conv1D: [in, out]
    assert (attn.dim, attn.parts) == (1, (16, 16, 16))
    assert p["transformer.h.0.attn.c_proj.weight"].dim == 0


def test_heads_that_t_does_not_divide_stay_replicated_and_say_so(graphs):
    """4 query heads over T=4 divide, 2 key/value heads do not: that attention replicated."""
    plan = choose(graphs["llama"][0], 4)
    assert not any("self_attn" in n for n in plan.params)
    assert "model.layers.0.mlp.gate_proj.weight" in plan.params  # 32 features over 4
    assert any("k_proj" in note and "does not divide by T=4" in note for note in plan.notes)


def test_nothing_to_shard_says_so():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    plan = choose(_stage(model, (torch.randn(4, 8, dtype=torch.float64),),
                         lambda out, _: out.sum()), 2)
    assert plan.params == {} and "nothing to shard at T=2" in plan.summary()


def _view_node(heads: int):
    """The view of (b, t, 16) features into (b, t, heads, 16 / heads), with its meta shapes."""
    def f(x):
        return x.view(2, 3, heads, 16 // heads)

    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(f, tracing_mode="fake")(
        torch.zeros(2, 3, 16))
    (node,) = [n for n in graph.graph.nodes if n.op == "call_function"]
    return node


def test_a_view_into_heads_keeps_the_split_where_t_divides_the_heads():
    from pipecompile.passes.tensor_rules import State, rule

    node = _view_node(4)
    split = {node.args[0]: State(2, (16,), frozenset({"fc"}))}
    assert rule(node, split, 2, set()) == State(2, (16,), frozenset({"fc"}), fresh=False)
    assert rule(node, split, 8, set()) == "4 (heads) does not divide by T=8"


def test_attention_heads_count_gqa_key_value_heads_before_their_repeat(graphs):
    """Llama repeats its 2 key/value heads to the 4 query heads (expand, reshape) before the
    fused attention: the heads found are those of k_proj, not of the repeat."""
    from pipecompile.passes.tensor_rules import attention_heads_of

    assert attention_heads_of(graphs["llama"][0]) == ((4, 2),)
    assert attention_heads_of(graphs["gpt"][0]) == ((2, 2),)


def test_a_given_t_that_does_not_divide_the_key_value_heads_is_refused(graphs):
    """The planner's check of a given T (a cluster's layout search): 4 query heads divide by
    T=4, the 2 key/value heads do not: a ConfigError naming both. At run time (torchrun) the
    pass keeps that attention whole instead (exact: see the test above on T=4)."""
    from types import SimpleNamespace

    from pipecompile.errors import ConfigError
    from pipecompile.planner.layout_passes import _check_kv_heads

    plan = SimpleNamespace(ready=SimpleNamespace(captured=SimpleNamespace(
        module=graphs["llama"][0])))
    _check_kv_heads(plan, 2)
    with pytest.raises(ConfigError, match="tensor_parallel=4 does not divide the 2 key/value "
                                          r"heads .*4 query heads.*use one of \[1, 2\]"):
        _check_kv_heads(plan, 4)


def _split_all(layer):
    return True, f"{layer.name} split"


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2"])
@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "sp"])
def test_vocabulary_parallel_ranks_compute_the_unsplit_graph(graphs, name, sequence):
    """Embeddings and the output layer split along the vocabulary (GPT's and GPT-2's tied
    table for both, Llama's two tables apart): each rank holds 1/T of the vocabulary's rows,
    the outputs (whole logits) and every gradient are the unsplit graph's, with sequence
    parallelism too."""
    gm, args = graphs[name]
    plan = choose(gm, 2, vocabulary=_split_all)
    table = {"gpt": "lm_head.weight", "gpt2": "lm_head.weight",
             "llama": "model.embed_tokens.weight"}[name]
    assert plan.params[table].role == "vocabulary" and plan.params[table].dim == 0
    assert plan.params["lm_head.weight"].dim == 0 and plan.embeddings and plan.outputs
    assert not any("lm_head" in note for note in plan.notes)  # not "leaves the stage"
    want_gm = copy.deepcopy(gm)
    want = want_gm(*args)
    sum(o.sum() for o in want if o.is_floating_point()).backward()
    ranks, counts = run_lowered(gm, plan, args, sequence=sequence)
    assert counts["gather"] >= 1  # the logits, gathered along the vocabulary
    for outs, grads in ranks:
        for got, ref in zip(outs, want):
            assert got.shape == ref.shape
            assert (got - ref).abs().max().item() <= 1e-12 * max(ref.abs().max().item(), 1)
        vocab = gm.get_parameter(table).shape[0]
        assert grads[table].shape[0] * 2 == vocab  # this rank's half of the rows
    _assert_gradients_match(want_gm, plan, ranks)


def test_vocabulary_kept_whole_when_the_choice_says_so(graphs):
    """The choice refused: the tables replicated, the plan's reason kept for explain()."""
    plan = choose(graphs["gpt2"][0], 2, vocabulary=lambda layer: (False, f"{layer.name} whole"))
    assert not any(p.role.startswith("vocabulary") for p in plan.params.values())
    assert not plan.embeddings and not plan.outputs
    assert "lm_head.weight whole" in plan.summary()


def test_vocabulary_layers_find_tied_and_untied_tables(graphs):
    from pipecompile.passes.tensor_shard import vocabulary_layers

    gpt2 = {layer.name: layer for layer, *_ in vocabulary_layers(graphs["gpt2"][0], 2)}
    assert gpt2["lm_head.weight"].roles == ("embedding", "output")  # tied with wte
    assert (gpt2["lm_head.weight"].vocab, gpt2["lm_head.weight"].hidden) == (64, 16)
    llama = {layer.name: layer.roles for layer, *_ in vocabulary_layers(graphs["llama"][0], 2)}
    assert llama == {"model.embed_tokens.weight": ("embedding",), "lm_head.weight": ("output",)}
    assert vocabulary_layers(graphs["llama"][0], 3) == []  # 64 rows: T=3 does not divide
