"""A model built on the meta device with tensor_parallel=2 (real gloo ranks, float64): its
weights initialised (the same as at T = 1) or loaded from a safetensors file, transformers
`save_pretrained` shards and a torch.distributed.checkpoint, each rank reading only its slice
of every split weight (fused projections too: GPT-2's c_attn, three pieces a rank); one step
equals the unsplit model's; `pipe.state_dict()` saves with DCP and loads back exactly, and
into the unsplit model. One 2-rank job for all of it."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import pipecompile as pc
from tests.distributed.ranks import run_ranks
from tests.distributed.tensor_parallel_cases import MODELS
from tests.distributed.tensor_parallel_weights_cases import (family_case, plan_weights,
                                                             run_weights, state)
from tests.support.reference import reference_step

NAMES = ["gpt2", "llama"]  # a fused qkv (Conv1D) and GQA


def _checkpoints(name: str, root) -> dict:
    """The eager model's weights as one .safetensors file, transformers shards (index json)
    and a DCP directory."""
    import torch.distributed.checkpoint as dcp

    model = MODELS[name]()[0]
    single, shards = root / f"{name}-single", root / f"{name}-shards"
    model.save_pretrained(single)
    model.save_pretrained(shards, max_shard_size="8KB")
    assert (shards / "model.safetensors.index.json").is_file()
    dcp.save(model.state_dict(), checkpoint_id=str(root / f"{name}-dcp"), no_dist=True)
    return {"safetensors": str(single / "model.safetensors"), "shards": str(shards),
            "dcp": str(root / f"{name}-dcp")}


def _init_at_one(name: str) -> dict:
    """init_weights of the meta model compiled unsplit (T = 1), in this process."""
    with pc.meta_parameters():
        model, args, kwargs, _, loss_fn = MODELS[name]()
    pipe = pc.compile(model, example_inputs=args, example_kwargs=kwargs, devices=1,
                      loss_fn=loss_fn, schedule="gpipe", microbatches=2)
    pipe.to_empty()
    torch.manual_seed(0)
    pipe.init_weights(model._init_weights)
    return state(pipe)


# the real-model sweep's families (tests/integration/test_real_models.py) at T = 2, in this job
FAMILIES = ["gpt2", "llama", "bert_mlm", "vit"]


def _family(name: str, root) -> tuple:
    """Family `name` seeded as the sweep seeds it, a language model saved in shards as the
    sweep saves it; its checkpoint, and the reference step (loss, gradients)."""
    from tests.support.real_models import FAMILIES as BUILT

    torch.manual_seed(0)
    model = BUILT[name].build().double()
    checkpoint = root / f"family-{name}"
    if BUILT[name].meta:
        model.save_pretrained(checkpoint, max_shard_size="20KB")
    args, kwargs, target, loss_fn = family_case(name)
    loss, grads = reference_step(model, args, kwargs, target, loss_fn, 2)
    return str(checkpoint), loss.item(), {n: g.clone() for n, g in grads.items()}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_weights")
    paths = {name: _checkpoints(name, root) for name in NAMES}
    families = {name: _family(name, root) for name in FAMILIES}
    out = root / "saved"
    out.mkdir()
    results = run_ranks(run_weights, 2, NAMES, paths, str(out),
                        {n: f[0] for n, f in families.items()}, timeout=900,
                        warm=functools.partial(plan_weights, NAMES, list(FAMILIES)))
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r.get("trace", r))
    return paths, str(out), results, families


def _close(got: dict, want: dict, tol: float = 0.0) -> float:
    assert set(got) == set(want)
    worst = 0.0
    for key, tensor in want.items():
        err = (got[key] - tensor).abs().max().item() / max(tensor.abs().max().item(), 1e-300)
        worst = max(worst, err)
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("name", NAMES)
def test_init_weights_at_two_equals_one(job, name):
    want = _init_at_one(name)
    for rank in job[2]:
        _close(rank[name]["init"], want)  # exactly: the same generator per module


@pytest.mark.parametrize("kind", ["safetensors", "shards", "dcp"])
@pytest.mark.parametrize("name", NAMES)
def test_load_weights_fills_the_shards_with_the_checkpoint(job, name, kind):
    want = MODELS[name]()[0].state_dict()
    for rank in job[2]:
        _close(rank[name][kind]["state"], want)


@pytest.mark.parametrize("kind", ["safetensors", "shards"])
@pytest.mark.parametrize("name", NAMES)
def test_each_rank_reads_only_its_slice(job, name, kind):
    """Of every split weight a rank reads 1/2 (the c_attn weight as three pieces; the
    embedding and output tables half their vocabulary rows); the rest whole; in all a little
    over half the file's tensor bytes."""
    model = MODELS[name]()[0]
    whole = {k: v.nbytes for k, v in model.state_dict().items()}
    saved = set(job[2][0][name][kind]["bytes"])
    for rank in job[2]:
        found = rank[name]
        split = {k for k, shape in found["local"].items() if shape != tuple(model.state_dict()[k].shape)}
        assert split  # something is split
        for key, read in found[kind]["bytes"].items():
            assert read == (whole[key] // 2 if key in split else whole[key]), key
        tables = {"gpt2": ["transformer.wte.weight"],
                  "llama": ["model.embed_tokens.weight", "lm_head.weight"]}[name]
        for key in tables:  # vocab_parallel=True: half of the vocabulary's rows read
            assert key in split and found[kind]["bytes"][key] == whole[key] // 2, key
        if name == "gpt2":
            shapes = found[kind]["shapes"]["transformer.h.0.attn.c_attn.weight"]
            assert shapes == [(16, 8)] * 3  # q_r, k_r, v_r: of [16, 48], 8 columns of each part
        total = sum(found[kind]["bytes"].values())
        assert total < 0.8 * sum(whole[k] for k in saved)
    assert saved <= set(whole)


@pytest.mark.parametrize("name", NAMES)
def test_a_step_after_loading_equals_the_unsplit_model(job, name):
    model, args, kwargs, target, loss_fn = MODELS[name]()
    loss, grads = reference_step(model, args, kwargs, target, loss_fn, 2)
    for rank in job[2]:
        assert abs(rank[name]["loss"] - loss.item()) <= 1e-10 * abs(loss.item())
        _close(rank[name]["grads"], {n: g for n, g in grads.items()}, tol=1e-9)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", NAMES)
def test_dcp_of_the_shards_round_trips_and_loads_unsplit(job, name):
    """dcp.save(pipe.state_dict()) (GPT-2's c_attn as its three pieces a rank), zeroed,
    dcp.load back: the same weights; the checkpoint loads into the unsplit model; and
    load_weights from it reads each rank's own chunks."""
    import torch.distributed.checkpoint as dcp

    want = MODELS[name]()[0].state_dict()
    for rank in job[2]:
        _close(rank[name]["dcp_round_trip"], want)
        _close(rank[name]["from_own_dcp"]["state"], want)
    fresh = MODELS[name]()[0]
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = fresh.state_dict()
    dcp.load(loaded, checkpoint_id=os.path.join(job[1], name), no_dist=True)
    fresh.load_state_dict(loaded)
    _close(state(fresh), want)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", NAMES)
def test_the_optimizer_state_of_the_shards_round_trips_through_dcp(job, name):
    """get_state_dict(pipe, AdamW) after a step, fused projections' moments included, saved
    with DCP, zeroed and loaded back: every value the same; the saved first moments of the
    whole model are the unsplit model's (0.1 x its gradient after one step)."""
    from pipecompile.weights.read import read_tensors

    for rank in job[2]:
        assert rank[name]["optim"]["worst"] == 0.0
    fused = job[2][0][name]["optim"]["fused"]
    assert fused == ([f"transformer.h.{i}.attn.c_attn.{w}" for i in (0, 1)
                      for w in ("bias", "weight")] if name == "gpt2" else [])
    model, args, kwargs, target, loss_fn = MODELS[name]()
    _, grads = reference_step(model, args, kwargs, target, loss_fn, 2)
    saved = read_tensors(os.path.join(job[1], f"{name}-optim"),
                         [f"optim.state.{n}.exp_avg" for n in grads])
    assert len(saved) == len(grads)
    _close({n: saved[f"optim.state.{n}.exp_avg"] for n in grads},
           {n: 0.1 * g for n, g in grads.items()}, tol=1e-9)


@pytest.mark.parametrize("name", FAMILIES)
def test_real_model_family_at_t2_equals_the_unsplit_model(job, name):
    """The real-model sweep's family at tensor_parallel=2 (a language model built on meta and
    loaded from its shards): loss to 1e-10, every gradient to 1e-9 of its scale, something
    split. A key bias's gradient is zero in exact arithmetic (softmax ignores a constant over
    the keys): its rounding noise, up to 2e-19 of the largest gradient, depends on the order
    the row's all-reduce sums in, so no gradient is held closer than 1e-15 of the largest (a
    few float64 ulps of it): its scale is at least 1e-6 of the largest."""
    _, want_loss, want = job[3][name]
    largest = max(g.abs().max().item() for g in want.values())
    worst = 0.0
    for rank in job[2]:
        got = rank["families"][name]
        assert abs(got["loss"] - want_loss) <= 1e-10 * abs(want_loss), (got["loss"], want_loss)
        assert sorted(got["grads"]) == sorted(want)
        for key, grad in want.items():
            scale = max(grad.abs().max().item(), 1e-6 * largest)  # tol / 1e-9
            err = (got["grads"][key] - grad).abs().max().item() / scale
            assert err <= 1e-9, key
            worst = max(worst, err)
        assert got["split"], got["explain"]
    loss = max(abs(r["families"][name]["loss"] - want_loss) / abs(want_loss) for r in job[2])
    print(f"{name}: {len(got['split'])} parameters split; loss {loss:.1e}, gradients "
          f"{worst:.1e} relative")  # -s
