"""Tensor parallelism with FSDP (tensor_parallel=T, data_parallel=D, fsdp=True) and with
recomputation (checkpoint=True) on gloo in float64. FSDP2 shards the tensor-parallel DTensors
over "dp" of one (dp, pp, tp) mesh; a recomputed stage runs its forward's collectives again
in backward. One step's loss and gradients equal the unsplit model's on the global batch,
each rank holds 1/(T D) of every split weight and 1/D of the rest under FSDP, and the
parameters stay DTensors whose full_tensor() is the unsplit value."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.ranks import run_ranks
from tests.distributed.tensor_parallel_cases import MODELS, plan_once
from tests.distributed.tensor_parallel_fsdp_cases import run_cases
from tests.support.reference import reference_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FSDP2 = (("data_parallel", 2), ("fsdp", True))
SP = (("sequence_parallel", True),)
RECOMPUTE = (("checkpoint", True),)
VOCAB = (("vocab_parallel", True),)  # the other cases keep the vocabulary whole
# (model, pipeline devices P, schedule, options): T = world / (P D)
TP2_FSDP2 = [("gpt", 1, "1f1b", FSDP2), ("llama", 1, "gpipe", FSDP2), ("gpt2", 1, "1f1b", FSDP2),
             ("gpt", 1, "gpipe", FSDP2 + SP), ("gpt2", 1, "gpipe", FSDP2 + VOCAB)]
PP2_TP2_RECOMPUTE = [("gpt", 2, "1f1b", RECOMPUTE), ("llama", 2, "gpipe", RECOMPUTE + SP)]
DP2_TP2_RECOMPUTE = [("llama", 1, "1f1b", (("data_parallel", 2),) + RECOMPUTE)]
PP2_TP2_FSDP2 = [("gpt", 2, "1f1b", FSDP2), ("llama", 2, "interleaved-1f1b", FSDP2)]


def _id(case: tuple) -> str:
    names = {"fsdp": "fsdp2", "sequence_parallel": "sp", "checkpoint": "recompute",
             "vocab_parallel": "vocab"}
    return "-".join(map(str, case[:3])) + "".join(f"-{names[k]}" for k, _ in case[3]
                                                 if k in names)


@functools.cache  # the same for every test of the case; the tests only read it
def _reference(name: str, microbatches: int) -> dict:
    """The unsplit model on the global batch in `microbatches`: loss, gradients, weights,
    gradient norm; then one AdamW step, its state and the next loss."""
    model, args, kwargs, target, loss_fn = MODELS[name]()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss, grads = reference_step(model, args, kwargs, target, loss_fn, microbatches)
    grads = {n: g.clone() for n, g in grads.items()}
    norm = torch.sqrt(sum((g * g).sum() for g in grads.values())).item()
    opt.step()
    stepped = {n: t.detach().clone() for n, t in model.state_dict().items()}
    loss2, _ = reference_step(model, args, kwargs, target, loss_fn, microbatches)
    return dict(loss=loss.item(), grads=grads, params=params, norm=norm, loss2=loss2.item(),
                stepped=stepped)


def _ranks(world: int, cases: list[tuple], directory: str | None = None,
           saved: tuple = (), loads: dict | None = None) -> list[dict]:
    warm = functools.partial(plan_once, [(c[0], c[1], dict(c[3]).get("data_parallel", 1))
                                         for c in cases], tuple((n, 2) for n in loads or ()))
    results = run_ranks(run_cases, world, cases, directory, saved, loads, timeout=900,
                        warm=warm)
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r.get("trace", r))
    return results


SAVED = (TP2_FSDP2[1], TP2_FSDP2[2])  # Llama (GQA) and GPT-2 (fused c_attn)
LOADED = ["llama", "gpt2"]  # built on meta and loaded from the unsplit model's checkpoints
KINDS = ["safetensors", "shards", "dcp"]


@pytest.fixture(scope="module")
def saved_to(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tp2_fsdp2"))


def _checkpoints(name: str, root: str) -> dict:
    """The unsplit model's weights as one .safetensors file, transformers shards (index
    json) and a DCP directory."""
    import os

    import torch.distributed.checkpoint as dcp

    model = MODELS[name]()[0]
    single, shards = os.path.join(root, f"{name}-single"), os.path.join(root, f"{name}-shards")
    model.save_pretrained(single)
    model.save_pretrained(shards, max_shard_size="8KB")
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(root, f"{name}-unsplit-dcp"),
             no_dist=True)
    return dict(zip(KINDS, (os.path.join(single, "model.safetensors"), shards,
                            os.path.join(root, f"{name}-unsplit-dcp"))))


@pytest.fixture(scope="module")
def four_ranks(saved_to) -> list[dict]:
    """One 4-rank job: TP2 x FSDP2 (Llama and GPT-2 also saved and loaded, and built on meta
    and loaded from the unsplit model's checkpoints), PP2 x TP2 and DP2 x TP2 with
    recomputation."""
    loads = {name: _checkpoints(name, saved_to) for name in LOADED}
    return _ranks(4, TP2_FSDP2 + PP2_TP2_RECOMPUTE + DP2_TP2_RECOMPUTE, saved_to, SAVED, loads)


@pytest.fixture(scope="module")
def pp2_tp2_fsdp2() -> list[dict]:
    return _ranks(8, PP2_TP2_FSDP2)  # one 8-rank job


def _check(results: list[dict], case: tuple) -> None:
    options = dict(case[3])
    D = options.get("data_parallel", 1)
    want = _reference(case[0], 2 * D)  # D replicas x 2 micro-batches
    T = len(results) // (case[1] * D)
    worst_loss = 0.0
    for rank, r in enumerate(results):
        got = r[case]
        assert got["layout"] == (case[1], D, T, options.get("fsdp", False))
        recomputes = options.get("checkpoint", False)
        assert got["recomputed"] == (list(range(case[1])) if recomputes else []), got["recomputed"]
        assert got["dtensor"]
        worst_loss = max(worst_loss, abs(got["loss"] - want["loss"]))
        assert abs(got["loss"] - want["loss"]) <= 1e-10, (rank, got["loss"], want["loss"])
        assert abs(got["norm"] - want["norm"]) <= 1e-9 * want["norm"], (rank, got["norm"])
        assert abs(got["loss2"] - want["loss2"]) <= 1e-9, (rank, got["loss2"])  # after AdamW
        assert abs(got["eval"] - want["loss2"]) <= 1e-9, (rank, got["eval"])
        for name, value in got["values"].items():  # full_tensor() is the unsplit weight
            assert torch.equal(value, want["params"][name]), (rank, name)
        for name, value in got["state"].items():  # state_dict() after the step
            stepped = want["stepped"][name]
            err = (value - stepped).abs().max().item()
            assert err <= 1e-10 * max(stepped.abs().max().item(), 1.0), (rank, name, err)
    seen, worst = set(), 0.0
    for r in results:
        for name, g in r[case]["grads"].items():
            ref = want["grads"][name]
            err = (g - ref).abs().max().item() / max(ref.abs().max().item(), 1e-300)
            assert err <= 1e-9, (case, name, err)
            seen.add(name)
            worst = max(worst, err)
    assert seen == set(want["grads"]), set(want["grads"]) - seen
    print(f"{_id(case)}: loss {worst_loss:.1e}, gradients {worst:.1e} relative")  # -s


def _held(results: list[dict], case: tuple, T: int) -> dict[str, tuple]:
    """name -> (local elements x T x D == whole: split over tp and dp, placements) on rank 0."""
    sizes = results[0][case]["sizes"]
    return {n: (local * T * 2 == whole, local * 2 == whole, placements)
            for n, (local, whole, placements) in sizes.items()}


@pytest.mark.parametrize("case", TP2_FSDP2, ids=_id)
def test_tp2_fsdp2_step_equals_the_unsplit_model(four_ranks, case):
    _check(four_ranks, case)


@pytest.mark.parametrize("case", PP2_TP2_FSDP2, ids=_id)
def test_pp2_tp2_fsdp2_on_eight_ranks_equals_the_unsplit_model(pp2_tp2_fsdp2, case):
    _check(pp2_tp2_fsdp2, case)


@pytest.mark.parametrize("case", PP2_TP2_RECOMPUTE + DP2_TP2_RECOMPUTE, ids=_id)
def test_tp2_with_recomputation_equals_the_unsplit_model(four_ranks, case):
    """checkpoint=True: every stage recomputes its forward (its collectives too) in
    backward."""
    _check(four_ranks, case)


def test_each_rank_holds_a_quarter_of_every_split_weight_and_half_of_the_rest(four_ranks):
    """GPT, TP2 x FSDP2: attention and MLP weights split over "tp" and sharded over "dp"
    (a quarter each); embeddings, norms, the rows' biases and the fused qkv's bias (FSDP could
    shard it only along its fused dim, no DTensor layout) whole over "tp", half over "dp";
    the fused qkv weight sharded over "dp" along its other dim; every parameter a DTensor
    over the (dp, tp) mesh."""
    held = _held(four_ranks, TP2_FSDP2[0], 2)
    split = {n for n, (quarter, _, _) in held.items() if quarter}
    assert split == {f"layers.{i}.{m}" for i in range(2) for m in (
        "attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.fc.bias",
        "mlp.proj.weight")}
    assert all(half for n, (_, half, _) in held.items() if n not in split)
    for name, (quarter, _, (mesh, placements)) in held.items():
        assert mesh == ("dp", "tp"), name
        assert (placements[1] != "R") == quarter, (name, placements)
    assert held["layers.0.attn.proj.weight"][2][1] == ("S(0)", "S(1)")  # the row: input dim
    assert held["layers.0.attn.qkv.weight"][2][1] == ("S(1)", "_S(0, 3)")  # q, k, v parts
    assert held["layers.0.attn.qkv.bias"][2][1] == ("S(0)", "R")


def test_gpt2_fused_conv1d_is_split_by_parts_and_sharded_along_its_rows(four_ranks):
    held = _held(four_ranks, TP2_FSDP2[2], 2)
    assert held["transformer.h.0.attn.c_attn.weight"][0]
    assert held["transformer.h.0.attn.c_attn.weight"][2][1] == ("S(0)", "_S(1, 3)")


def test_gqa_attention_is_split_by_heads_and_sharded(four_ranks):
    held = _held(four_ranks, TP2_FSDP2[1], 2)
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        assert held[f"model.layers.0.{m}.weight"][0], m


def test_explain_names_both_shardings(four_ranks):
    text = four_ranks[0][TP2_FSDP2[0]]["explain"]
    assert "0 of 2 tensor-parallel ranks" in text
    assert "fully_shard-ed over 2 data-parallel ranks (mesh dp x pp x tp = 2 x 1 x 2)" in text
    assert _row(text, "tensor_parallel").endswith("  2")  # the given T, resolved
    sp = four_ranks[0][TP2_FSDP2[3]]["explain"]
    assert _row(sp, "tensor_parallel").endswith("  2 + sequence parallel")


def _row(explain: str, option: str) -> str:
    """The row of `option` in explain()'s table of asked and resolved options."""
    return next(line for line in explain.splitlines() if line.startswith(option + " "))


def test_a_vocabulary_split_over_tp_is_sharded_over_dp_too(four_ranks):
    """GPT-2, TP2 x FSDP2, vocab_parallel=True: its tied wte/lm_head table split over "tp"
    along the vocabulary and sharded over "dp": a quarter of the rows a rank."""
    held = _held(four_ranks, TP2_FSDP2[4], 2)
    quarter, _, (mesh, placements) = held["transformer.wte.weight"]
    assert quarter and mesh == ("dp", "tp") and placements[1] == "S(0)", placements


@pytest.mark.parametrize("case", SAVED, ids=_id)
def test_tp2_fsdp2_saved_and_loaded_steps_the_same_and_dcp_round_trips(four_ranks, case):
    """After one AdamW step: pipe.save on every rank, pc.load under the same 4 ranks gives
    TP2 x FSDP2 again (the same placements over (dp, tp)) and its next step equals the
    original's bit for bit; dcp.save(pipe.state_dict()) loads into that pipeline, zeroed,
    exactly."""
    for r in four_ranks:
        saved, got = r[case]["saved"], r[case]
        assert saved["layout"].startswith("1 x 2 x TP2 (FSDP"), saved["layout"]
        assert saved["placements"]
        assert saved["loss"] == got["loss2"]
        assert sorted(saved["grads"]) == sorted(saved["grads2"]) and saved["grads2"]
        for name, grad in saved["grads2"].items():
            assert torch.equal(saved["grads"][name], grad), name
        assert saved["dcp_worst"] == 0.0


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("case", SAVED, ids=_id)
def test_a_dcp_checkpoint_of_tp2_fsdp2_shards_loads_into_the_unsplit_model(four_ranks,
                                                                           saved_to, case):
    """dcp.save(pipe.state_dict()) of TP2 x FSDP2 after one AdamW step, loaded in one process
    into the unsplit model: the unsplit model's own state after that step (to 1e-10)."""
    import os

    import torch.distributed.checkpoint as dcp

    want = _reference(case[0], 4)["stepped"]
    fresh = MODELS[case[0]]()[0]
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    state = fresh.state_dict()
    assert set(four_ranks[0][case]["saved"]["keys"]) == set(state)
    name = "-".join(map(str, case[:3]))
    dcp.load(state, checkpoint_id=os.path.join(saved_to, f"{name}-dcp"), no_dist=True)
    fresh.load_state_dict(state)
    for key, tensor in fresh.state_dict().items():
        err = (tensor - want[key]).abs().max().item()
        assert err <= 1e-10 * max(want[key].abs().max().item(), 1.0), (key, err)


@pytest.mark.parametrize("name", LOADED)
def test_load_weights_fills_tp2_fsdp2_shards_and_steps_as_the_unsplit_model(four_ranks, name):
    """A model built on meta, TP2 x FSDP2 with its vocabulary split: load_weights from a
    .safetensors file, save_pretrained shards and DCP (each after zeroing) gives the unsplit
    weights exactly; the step after equals the unsplit model's (loss to 1e-10, gradients to
    1e-9 relative)."""
    model = MODELS[name]()[0]
    want = {k: v for k, v in model.state_dict().items()}
    ref = _reference(name, 4)
    for rank, r in enumerate(four_ranks):
        found = r["loaded"][name]
        for kind in KINDS:
            got = found[kind]["state"]
            assert set(got) == set(want), kind
            for key, tensor in want.items():
                assert torch.equal(got[key], tensor), (rank, kind, key)
        assert abs(found["loss"] - ref["loss"]) <= 1e-10, (rank, found["loss"], ref["loss"])
        assert sorted(found["grads"]) == sorted(ref["grads"])
        for key, grad in ref["grads"].items():
            err = (found["grads"][key] - grad).abs().max().item() / grad.abs().max().item()
            assert err <= 1e-9, (rank, key, err)


@pytest.mark.parametrize("kind", KINDS[:2])
@pytest.mark.parametrize("name", LOADED)
def test_each_tp2_fsdp2_rank_reads_a_quarter_of_every_split_weight(four_ranks, name, kind):
    """Counted through safetensors' `get_slice`: of every key a rank reads exactly the bytes
    it holds, a quarter (1 / (T D)) of each weight split over "tp" and "dp" (GPT-2's fused
    c_attn as three [8, 8] blocks of its [16, 48]: rows over "dp", a part's columns over
    "tp"), half of the rest (sharded over "dp"); in all about a quarter of the file."""
    whole = {k: v.nbytes for k, v in MODELS[name]()[0].state_dict().items()}
    for r in four_ranks:
        found = r["loaded"][name]
        read = found[kind]["bytes"]
        assert found["split"] and set(found["split"]) <= set(read)
        for key, count in read.items():
            assert count == found["held"][key], key
        for key in found["split"]:
            assert read[key] * 4 == whole[key], key
        if name == "gpt2":
            shapes = found[kind]["shapes"]["transformer.h.0.attn.c_attn.weight"]
            assert shapes == [(8, 8)] * 3, shapes
        assert sum(read.values()) <= 0.27 * sum(whole[k] for k in read)
