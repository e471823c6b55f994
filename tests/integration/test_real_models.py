"""The real-model sweep: transformers families (tests/support/real_models.py), each trained the way its
users train it (the model's own loss from `labels=`), exact against the unsplit eager model at 2
and 4 stages in float64: the loss and every parameter's gradient.

The language models go the README's "Models bigger than one process" way: built under
`torch.device("meta")`, compiled, `pipe.to_empty()`, `pipe.load_weights(dir)` from a
`save_pretrained` directory of several shards; their reference is the model that was saved, and
every tensor the pipeline holds after loading (non-persistent buffers such as RoPE's `inv_freq`
included) must equal that model's.

One compile per (family, stage count); each family's source model, checkpoint and reference step
are built once (a module-scoped fixture) for its stage counts. Gemma3n (decoder layers kept
opaque: a `.data` write), JetMoE (data-dependent split sizes, priced by estimate) and
Parakeet-CTC (its CTC loss in loss_fn) run at 2 stages. PhiMoE, whose opaque routers draw
random numbers, cannot equal an eager run: its test compares 1, 2 and 4 stages under
rng="per-microbatch".

Tensor parallelism needs ranks, not device threads: GPT-2, Llama, BERT-MLM and ViT of this
sweep also run at tensor_parallel=2 (built and loaded the same way, loss to 1e-10, gradients
to 1e-9) inside the 2-rank gloo job of tests/distributed/test_tensor_parallel_weights.py
(`test_real_model_family_at_t2_equals_the_unsplit_model`, one test id per family).
"""

from __future__ import annotations

import copy
import json
from typing import Any, Iterator

import pytest
import torch

import pipecompile as pc

from tests.support.real_models import FAMILIES, Family, lm_batch, own_loss, parakeet_ctc_loss, phimoe
from tests.support.reference import assert_grads_equal, reference_step

MICROBATCHES = 2


def _state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    yield from model.named_buffers()


class _Source:
    """A family's seeded float64 model (saved in shards for a meta family), its batch, and the
    reference step on a copy of it: loss and gradients of the mean micro-batch loss."""

    def __init__(self, family: Family, tmp_path_factory: pytest.TempPathFactory):
        torch.manual_seed(0)
        self.family = family
        self.model = family.build().double()
        self.args, self.kwargs = family.batch()
        self.target: Any = family.target() if family.target is not None else None
        self.loss_fn = family.loss_fn or own_loss
        self.checkpoint = None
        if family.meta:
            self.checkpoint = tmp_path_factory.mktemp(family.name)
            self.model.save_pretrained(self.checkpoint, max_shard_size="20KB")
        self.state = {k: v.detach().clone() for k, v in _state(self.model)}
        loss, grads = reference_step(copy.deepcopy(self.model), self.args, self.kwargs,
                                     self.target, self.loss_fn, MICROBATCHES)
        self.loss = loss.detach()
        self.grads = {n: g.clone() for n, g in grads.items()}

    def model_to_compile(self) -> torch.nn.Module:
        """A meta build (weights come from the checkpoint), or a copy of the source model."""
        if not self.family.meta:
            return copy.deepcopy(self.model)
        with torch.device("meta"):
            return self.family.build().double()


TWO_STAGES_TOO = ("gpt2", "llama", "mixtral", "bart")
TWO_STAGES_ONLY = ("gemma3n", "jetmoe", "parakeet_ctc")  # each capture takes longer
CASES = [pytest.param(name, stages, id=f"{name}-{stages}") for name in FAMILIES
         for stages in ((2, 4) if name in TWO_STAGES_TOO else
                        (2,) if name in TWO_STAGES_ONLY else (4,))]


@pytest.fixture(scope="module")
def src(request, tmp_path_factory) -> _Source:
    return _Source(FAMILIES[request.param], tmp_path_factory)


@pytest.mark.parametrize("src, stages", CASES, indirect=["src"])
def test_family_trains_exactly(src, stages):
    name = src.family.name
    pipe = pc.compile(src.model_to_compile(), src.args, src.kwargs, devices=stages,
                      microbatches=MICROBATCHES, schedule="1f1b", loss_fn=src.loss_fn,
                      **dict(src.family.options))
    assert len(pipe.program.stages) == stages
    if src.family.meta:
        index = json.loads((src.checkpoint / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # several shards
        pipe.to_empty()
        result = pipe.load_weights(src.checkpoint)
        assert list(result.missing_keys) == [] and list(result.unexpected_keys) == [], result
        held = dict(_state(pipe))
        assert held.keys() == src.state.keys()
        for key, value in src.state.items():
            assert held[key].dtype == value.dtype, f"{name}: {key} is {held[key].dtype}"
            assert torch.equal(held[key], value), f"{name}: {key} differs after loading"

    loss = pipe.step(*src.args, target=src.target, **src.kwargs)

    assert loss.dim() == 0 and loss.dtype == src.loss.dtype, (loss.shape, loss.dtype)
    assert torch.allclose(loss, src.loss, rtol=1e-12, atol=0), (
        f"{name}, {stages} stages: loss {loss.item()!r}, unsplit {src.loss.item()!r}")
    # a gradient zero in exact arithmetic (BART's attention key biases) is compared against
    # 1e-12 of the largest: on 4 stages the encoder's output gradient sums its two decoder
    # layers' terms in another order (each sum differs in the last bit, 1e-16 relative)
    compared = assert_grads_equal(pipe, src.grads, floor=1e-12)
    assert sorted(compared) == sorted(src.grads)


def test_wav2vec2_ctc_labels_refused_naming_the_line():
    """Wav2Vec2ForCTC's forward checks `labels.max()` in Python: not capturable; the error
    names the file and line, so the user knows to compute the loss in loss_fn (as the sweep
    does with transformers' own ForCTCLoss)."""
    family = FAMILIES["wav2vec2_ctc"]
    args, _ = family.batch()
    with pytest.raises(pc.CaptureError, match=r"modeling_wav2vec2\.py:\d+"):
        pc.compile(family.build().double(), args, {"labels": family.target()}, devices=2,
                   microbatches=MICROBATCHES, schedule="1f1b", loss_fn=own_loss)


def test_parakeet_ctc_loss_fn_is_its_own_loss():
    """The sweep trains Parakeet-CTC with `parakeet_ctc_loss` as loss_fn: on the unsplit model
    that is exactly the loss (and gradients) `labels=` gives."""
    family = FAMILIES["parakeet_ctc"]
    torch.manual_seed(0)
    model = family.build().double()
    args, kwargs = family.batch()
    labels = family.target()
    own = model(*args, labels=labels, **kwargs).loss
    own_grads = torch.autograd.grad(own, list(model.parameters()))
    routed = parakeet_ctc_loss(model(*args, **kwargs), labels)
    routed_grads = torch.autograd.grad(routed, list(model.parameters()))
    assert torch.equal(routed, own), (routed.item(), own.item())
    assert all(torch.equal(a, b) for a, b in zip(routed_grads, own_grads))


def test_parakeet_ctc_labels_refused_pointing_to_loss_fn():
    """ParakeetForCTC(labels=...) runs F.ctc_loss with tensor lengths: not capturable. The
    error names the loss's line and says to compute the loss in loss_fn (what the sweep does),
    not to make transformers' code traceable."""
    family = FAMILIES["parakeet_ctc"]
    args, kwargs = family.batch()
    with pytest.raises(pc.CaptureError, match=r"loss_ctc\.py:\d+") as caught:
        pc.compile(family.build().double(), args, {**kwargs, "labels": family.target()},
                   devices=2, microbatches=MICROBATCHES, schedule="1f1b", loss_fn=own_loss,
                   symbolic_sizes="batch")
    message = str(caught.value)
    assert "loss_fn" in message and "target=labels" in message, message
    assert "make that code traceable" not in message, message


def test_phimoe_jitter_same_at_1_2_and_4_stages():
    """PhiMoE's routers stay opaque (a custom autograd.Function) and draw random numbers (their
    jitter): with rng="per-microbatch" they draw from the micro-batch's stream as the captured
    random ops do, so a step on 1, 2 and 4 stages gives one loss and one set of gradients."""
    torch.manual_seed(0)
    source = phimoe().double()
    args, kwargs = lm_batch()
    results = []
    for stages in (1, 2, 4):
        pipe = pc.compile(copy.deepcopy(source), args, kwargs, devices=stages,
                          microbatches=MICROBATCHES, schedule="1f1b", loss_fn=own_loss,
                          rng="per-microbatch", symbolic_sizes="batch")
        assert len(pipe.program.stages) == stages
        seeded = next(line for line in pipe.explain().splitlines() if "random ops seeded" in line)
        assert "model.layers.0.mlp.router" in seeded, seeded
        loss = pipe.step(*args, **kwargs)
        results.append((loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}))
    (loss_1, grads_1), *others = results
    for stages, (loss, grads) in zip((2, 4), others):
        assert torch.allclose(loss, loss_1, rtol=1e-12, atol=0), (stages, loss, loss_1)
        assert grads.keys() == grads_1.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, grads_1[name], rtol=1e-10, atol=1e-14), (stages, name)
