"""Tensor parallelism (tensor_parallel=T) on gloo in float64: one step's loss and gradients
equal the unsplit model's on the same batch; each rank holds 1/T of every split weight, and
the parameters are DTensors whose full_tensor() is the unsplit value."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.ranks import run_ranks
from tests.distributed.tensor_parallel_cases import MODELS, plan_once, run_cases
from tests.support.reference import reference_step

# "sp": sequence_parallel=True, in the same jobs (one spawn each, no new one)
TP2_SP = [("gpt", 1, "1f1b", "sp"), ("llama", 1, "gpipe", "sp")]
# "vocab": vocab_parallel=True: embeddings and the output layer split along the vocabulary
TP2_VOCAB = [("gpt2", 1, "1f1b", "vocab"), ("llama", 1, "gpipe", "vocab"),
             ("llama", 1, "1f1b", "sp", "vocab"),
             # the cross entropy vocabulary-parallel: the pipeline's (the test GPT's tied
             # table), the model's own from labels= (-100s among them); a loss that is not
             # only cross entropy reads the gathered logits
             ("gpt", 1, "1f1b", "vocab"), ("llama_labels", 1, "gpipe", "vocab"),
             ("gpt_square", 1, "gpipe", "vocab"),
             # label smoothing and class weights lower too (runtime/vocab_loss.py)
             ("gpt_smoothed", 1, "1f1b", "vocab"), ("llama_weighted", 1, "gpipe", "vocab")]
TP2 = [("gpt", 1, "gpipe"), ("llama", 1, "1f1b"), ("gpt2", 1, "1f1b"), *TP2_SP, *TP2_VOCAB]
PP2_TP2_SP = [("gpt", 2, "1f1b", "sp"), ("llama", 2, "1f1b", "sp")]
# Llama's tables on the first and last stage split; GPT-2's tied across the stages kept whole
PP2_TP2_VOCAB = [("llama", 2, "1f1b", "vocab"), ("gpt2", 2, "gpipe", "vocab"),
                 ("llama_labels", 2, "1f1b", "vocab")]
PP2_TP2 = [("gpt", 2, "gpipe"), ("gpt", 2, "1f1b"), ("llama", 2, "1f1b"), ("gpt2", 2, "gpipe"),
           ("gpt", 2, "zb-h1"), ("gpt", 2, "interleaved-1f1b"), *PP2_TP2_SP, *PP2_TP2_VOCAB]


@functools.cache  # the same for every test of the case; the tests only read it
def _reference(name, microbatches=2):
    """The unsplit model's loss and gradients, and its loss after one AdamW step (the global
    batch in `microbatches`: D replicas x 2 each)."""
    model, args, kwargs, target, loss_fn = MODELS[name]()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss, grads = reference_step(model, args, kwargs, target, loss_fn, microbatches)
    grads = {n: g.clone() for n, g in grads.items()}
    opt.step()
    stepped = {n: t.detach().clone() for n, t in model.state_dict().items()}
    loss2, _ = reference_step(model, args, kwargs, target, loss_fn, microbatches)
    return loss.item(), grads, params, loss2.item(), stepped




def _ranks(world, cases, replicas=1, directory=None):
    warm = functools.partial(plan_once, [(c[0], c[1], replicas) for c in cases])
    results = run_ranks(run_cases, world, cases, replicas, directory, timeout=900, warm=warm)
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r.get("trace", r))
    return results


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tp2"))
    return directory, _ranks(2, TP2, directory=directory)


@pytest.fixture(scope="module")
def pp2_tp2(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pp2_tp2"))
    return directory, _ranks(4, PP2_TP2 + TP4, directory=directory)  # one 4-rank job


TP4 = [("gpt4", 1, "1f1b")]
DP2_TP2 = [("gpt", 1, "1f1b"), ("llama", 1, "gpipe"), ("llama", 1, "1f1b", "sp")]
PP2_TP2_DP2 = [("gpt", 2, "1f1b")]


@pytest.fixture(scope="module")
def dp2_tp2():
    return _ranks(4, DP2_TP2, replicas=2)


@pytest.fixture(scope="module")
def pp2_tp2_dp2():
    return _ranks(8, PP2_TP2_DP2, replicas=2)


def _check(results, case, replicas=1):
    loss, grads, params, loss2, _ = _reference(case[0], 2 * replicas)
    for rank, r in enumerate(results):
        got = r[case]
        P, T = case[1], len(results) // (case[1] * replicas)
        assert got["layout"] == (P, replicas, T)  # pipe.layout reports the given T
        assert got["sp"] == ("sp" in case[3:])
        assert abs(got["loss"] - loss) <= 1e-10, (rank, got["loss"], loss)
        assert abs(got["loss2"] - loss2) <= 1e-9, (rank, got["loss2"], loss2)  # after AdamW
        # the same weights, forward only: eval_step and pipe(x) on every rank
        assert abs(got["eval"] - loss2) <= 1e-9
        # (labels with -100s, class weights: the whole batch's mean is not the micro-batches'
        # mean)
        assert replicas > 1 or case[0] in ("llama_labels", "llama_weighted") or \
            abs(got["forward"] - loss2) <= 1e-9
    # gradients: every parameter, from the ranks that hold its stage (all, in full_tensor())
    seen, worst = set(), 0.0
    for r in results:
        for name, g in r[case]["grads"].items():
            want = grads[name]
            err = (g - want).abs().max().item() / max(want.abs().max().item(), 1e-300)
            assert err <= 1e-9, (case, name, err)
            seen.add(name)
            worst = max(worst, err)
    assert seen == set(grads), set(grads) - seen
    print(f"{case}: loss {max(abs(r[case]['loss'] - loss) for r in results):.1e}, "
          f"gradients {worst:.1e} relative")  # shown with -s


@pytest.mark.parametrize("case", TP2, ids=lambda c: "-".join(map(str, c)))
def test_tp2_step_equals_the_unsplit_model(tp2, case):
    _check(tp2[1], case)


@pytest.mark.parametrize("case", PP2_TP2, ids=lambda c: "-".join(map(str, c)))
def test_pp2_tp2_step_equals_the_unsplit_model(pp2_tp2, case):
    _check(pp2_tp2[1], case)


def test_tp4_step_equals_the_unsplit_model_with_a_quarter_per_rank(pp2_tp2):
    case = TP4[0]
    _check(pp2_tp2[1], case)
    sizes = pp2_tp2[1][0][case]["sizes"]
    quarter = {n for n, (local, whole, _) in sizes.items() if local * 4 == whole}
    assert {n for n in sizes if ".attn." in n or ".mlp." in n} - quarter == {
        f"layers.{i}.{m}.bias" for i in range(2) for m in ("attn.proj", "mlp.proj")}


@pytest.mark.parametrize("case", DP2_TP2, ids=lambda c: "-".join(map(str, c)))
def test_dp2_tp2_step_equals_the_unsplit_model(dp2_tp2, case):
    """2 replicas x 2 tensor-parallel ranks, each replica its half of the batch."""
    _check(dp2_tp2, case, replicas=2)


@pytest.mark.parametrize("case", PP2_TP2_DP2, ids=lambda c: "-".join(map(str, c)))
def test_pp2_tp2_dp2_on_eight_ranks_equals_the_unsplit_model(pp2_tp2_dp2, case):
    _check(pp2_tp2_dp2, case, replicas=2)


def test_each_rank_holds_half_of_every_split_weight(tp2):
    """The GPT's attention and MLP weights are split in two; embeddings, norms and the output
    layer stay whole; every parameter is a DTensor whose full_tensor() is the model's."""
    _, _, params, _, _ = _reference("gpt")
    sizes = tp2[1][0][("gpt", 1, "gpipe")]["sizes"]
    split = {n for n, (local, whole, _) in sizes.items() if local * 2 == whole}
    assert split == {f"layers.{i}.{m}" for i in range(2) for m in (
        "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight",
        "mlp.fc.bias", "mlp.proj.weight")}
    assert all(local == whole for n, (local, whole, _) in sizes.items() if n not in split)
    assert all(kind == "DTensor" for _, _, kind in sizes.values())
    for r in tp2[1]:
        assert r[("gpt", 1, "gpipe")]["dtensor"]
        for name, value in r[("gpt", 1, "gpipe")]["values"].items():
            assert torch.equal(value, params[name]), name
        state = r[("gpt", 1, "gpipe")]["state"]  # state_dict(): original keys, DTensors
        assert all(torch.equal(state[n], params[n]) for n in params)


def test_gqa_attention_is_split_by_heads(tp2):
    """Llama with 4 query and 2 key/value heads: q, k, v, o and the MLP all split."""
    sizes = tp2[1][0][("llama", 1, "1f1b")]["sizes"]
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        local, whole, _ = sizes[f"model.layers.0.{m}.weight"]
        assert local * 2 == whole, m


def test_clipped_norm_counts_each_shard_once(tp2, pp2_tp2):
    """pipe.clip_grad_norm_ (and torch's own on the DTensors, TP alone) is the unsplit
    model's gradient norm: split gradients' shards summed, replicated ones counted once."""
    _, grads, _, _, _ = _reference("gpt")
    want = torch.sqrt(sum((g * g).sum() for g in grads.values())).item()
    for r in tp2[1]:
        assert abs(r[("gpt", 1, "gpipe")]["norm"] - want) <= 1e-9 * want
        assert abs(r[("gpt", 1, "gpipe")]["torch_norm"] - want) <= 1e-9 * want
    for r in pp2_tp2[1]:
        assert abs(r[("gpt", 2, "1f1b")]["norm"] - want) <= 1e-9 * want


def test_a_column_row_pair_costs_one_all_reduce(tp2):
    """GPT, 2 layers: 4 pairs (attention, MLP). Forward: one all-reduce per pair and no
    all-gather; backward adds one per column input (ln1's and ln2's outputs)."""
    comms = tp2[1][0][("gpt", 1, "gpipe")]["comms"]
    assert comms["forward"] == {"c10d.allreduce_": 4}, comms
    assert comms["both"] == {"c10d.allreduce_": 8}, comms


def test_sequence_parallel_splits_the_tokens_between_pairs(tp2):
    """GPT, 2 layers, TP2+SP: each row's all-reduce a reduce-scatter (run as an all-reduce
    keeping this rank's half: gloo has none), an all-gather before the 3 columns whose input
    is split and one before the output layer; explain() and the layout say so."""
    got = tp2[1][0][("gpt", 1, "1f1b", "sp")]
    assert got["comms"]["forward"] == {"c10d.allreduce_": 4, "c10d.allgather_": 4}, got["comms"]
    assert "sequence parallel" in got["explain"]


def test_explain_names_the_tensor_parallel_pass(tp2):
    text = tp2[1][0][("llama", 1, "1f1b")]["explain"]
    assert "0 of 2 tensor-parallel ranks" in text and "row-parallel" in text


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("fixture", ["tp2", "pp2_tp2"])
def test_a_dcp_checkpoint_of_the_shards_loads_into_the_unsplit_model(fixture, request):
    """Llama: get_state_dict(pipe, opt) after one AdamW step, DTensor shards under the
    original names, saved with torch.distributed.checkpoint, loads into the unsplit model (one
    process) as the unsplit model's own state after that step."""
    import torch.distributed.checkpoint as dcp

    directory, results = request.getfixturevalue(fixture)
    *_, stepped = _reference("llama")
    fresh = MODELS["llama"]()[0]
    saved = [c["saved"] for r in results for c in r.values() if c["saved"]]
    assert len(saved) == len(results)  # every rank took part
    assert set().union(*(s["keys"] for s in saved)) == set(fresh.state_dict())
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    fresh.load_state_dict(state["model"])
    for name, tensor in fresh.state_dict().items():
        want = stepped[name]
        assert (tensor - want).abs().max().item() <= 1e-10 * max(want.abs().max().item(), 1)


def test_vocabulary_parallel_holds_half_of_each_table_and_gathers_the_logits(tp2):
    """vocab_parallel=True: GPT-2's table tied between wte and lm_head, and Llama's
    embed_tokens and lm_head apart, each hold 32 of their 64 vocabulary rows per rank
    (DTensor Shard(0)); full_tensor() and state_dict() are the model's. Llama's forward: the
    4 pairs' all-reduces, one for the embedding's masked lookup, one all-gather of the
    logits; explain() shows the choice."""
    from torch.distributed.tensor import Shard

    for case in TP2_VOCAB[:2]:
        _, _, params, _, _ = _reference(case[0])
        tables = [n for n in params if n.endswith(("wte.weight", "embed_tokens.weight",
                                                   "lm_head.weight"))]
        assert len(tables) == (1 if case[0] == "gpt2" else 2)
        for r in tp2[1]:
            got = r[case]
            for name in tables:
                local, whole, kind = got["sizes"][name]
                assert (local * 2, kind) == (whole, "DTensor") and whole == 64 * 16, name
                assert got["placements"][name] == [Shard(0)], name
                assert torch.equal(got["values"][name], params[name])
                assert torch.equal(got["state"][name], params[name])
            assert "vocabulary" in got["explain"] and "vocab_parallel=True" in got["explain"]
    comms = tp2[1][0][("llama", 1, "gpipe", "vocab")]["comms"]
    assert comms["forward"] == {"c10d.allreduce_": 5, "c10d.allgather_": 1}, comms


def test_pp2_vocabulary_splits_each_stage_table_and_keeps_a_tie_across_stages_whole(pp2_tp2):
    """PP2 x TP2, vocab_parallel=True: Llama's embed_tokens (stage 0) and lm_head (stage 1)
    each half a rank; GPT-2's wte, tied to lm_head on the other stage, stays whole (exact
    either way: the steps above)."""
    held = {}
    for r in pp2_tp2[1]:
        for case in PP2_TP2_VOCAB:
            for name, (local, whole, _) in r[case]["sizes"].items():
                held[case[0], name] = (local, whole)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        local, whole = held["llama", name]
        assert local * 2 == whole == 64 * 16, name
    local, whole = held["gpt2", "transformer.wte.weight"]
    assert local == whole == 64 * 16


@pytest.mark.parametrize("fixture", ["tp2", "pp2_tp2"])
def test_a_saved_tensor_parallel_pipeline_loads_sharded_and_steps_the_same(fixture, request):
    """Llama after one AdamW step: pipe.save on every rank, pc.load under the same ranks
    gives the same layout (T kept), the same DTensor placements and weights, and its next
    step equals the original's next step bit for bit (and the unsplit model's to 1e-10)."""
    _, results = request.getfixturevalue(fixture)
    *_, loss2, stepped = _reference("llama")
    P = 2 if fixture == "pp2_tp2" else 1
    for r in results:
        case = next(c for k, c in r.items() if c["saved"])
        loaded = case["saved"]["loaded"]
        assert loaded["layout"].startswith(f"{P} x 1 x TP2"), loaded["layout"]
        assert loaded["placements"]
        assert loaded["state"] and set(loaded["state"]) <= set(stepped)  # this rank's stages
        for name, tensor in loaded["state"].items():
            want = stepped[name]
            assert (tensor - want).abs().max().item() <= 1e-10 * max(want.abs().max().item(), 1)
        assert loaded["loss"] == case["loss2"]
        assert abs(loaded["loss"] - loss2) <= 1e-10 * abs(loss2)
        grads2 = case["saved"]["grads2"]
        assert sorted(loaded["grads"]) == sorted(grads2) and grads2
        for name, grad in grads2.items():
            assert torch.equal(loaded["grads"][name], grad), name


def test_a_cross_entropy_over_split_logits_never_gathers_them(tp2, pp2_tp2):
    """vocab_parallel=True: the pipeline's cross entropy (GPT, GPT-2, Llama, Llama with SP:
    `loss_fn` traced and lowered) and Llama's own from labels= (in its graph; the logits it returns are not read
    by the loss) run vocabulary-parallel: a step runs no all-gather at all (TP2); a loss
    that also reads the logits otherwise (GPT's plus their squares) gathers them, once per
    micro-batch. Label smoothing (GPT) and class weights (Llama) lower too. Exact either way
    (the steps above)."""
    forms = {("gpt", 1, "1f1b", "vocab"): ("lowered",), ("llama", 1, "gpipe", "vocab"):
             ("lowered",), ("gpt2", 1, "1f1b", "vocab"): ("lowered",),
             ("llama", 1, "1f1b", "sp", "vocab"): ("lowered",), ("llama_labels", 1, "gpipe", "vocab"): ("unread", "in graph"),
             ("gpt_square", 1, "gpipe", "vocab"): ("gathered",),
             ("gpt_smoothed", 1, "1f1b", "vocab"): ("lowered",),
             ("llama_weighted", 1, "gpipe", "vocab"): ("lowered",)}
    for r in tp2[1]:
        for case, form in forms.items():
            assert r[case]["vocab_loss"] == form, (case, r[case]["vocab_loss"])
            gathers = r[case]["step_comms"]["all_gather"]
            if "sp" not in case:  # (SP all-gathers its tokens before each column)
                assert gathers == (2 if form == ("gathered",) else 0), (case, gathers)
    last = [r[("llama_labels", 2, "1f1b", "vocab")]["vocab_loss"] for r in pp2_tp2[1]]
    assert sorted(last) == [(), (), ("unread", "in graph"), ("unread", "in graph")]
    last = [r[("llama", 2, "1f1b", "vocab")]["vocab_loss"] for r in pp2_tp2[1]]
    assert sorted(last) == [(), (), ("lowered",), ("lowered",)]
