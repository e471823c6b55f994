"""Models built on the meta device: compiled without weights, then materialised, initialised
or loaded per process (pipecompile/materialize.py), compared with the eager model in float64."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import pipecompile as pc
from pipecompile import zoo
from pipecompile.materialize import init_weights, meta_parameters, name_seed

from tests.reference import assert_grads_equal, reference_step

SIZES = dict(vocab=64, dim=16, layers=4, heads=2, seq=8)


def _meta_gpt(**kw) -> torch.nn.Module:
    with torch.device("meta"):
        return zoo.GPT(**{**SIZES, **kw}).double()


def _ids(batch=8):
    return torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(1))


def _compile(model, devices=2, **kw):
    x = _ids()
    kw = {"schedule": "1f1b", "microbatches": 4, **kw}
    return pc.compile(model, example_inputs=(x,), devices=devices, loss_fn=zoo.lm_loss, **kw)


def test_meta_model_compiles_without_weights_and_refuses_to_run():
    pipe = _compile(_meta_gpt(), microbatches="auto", schedule="auto", profile=True)
    assert all(p.is_meta for p in pipe.parameters())
    assert "meta device: analytic costs only" in pipe.explain()
    assert "profile=True ignored" in pipe.explain()
    assert pipe.predicted is not None and pipe.predicted.makespan > 0
    x = _ids()
    with pytest.raises(pc.ConfigError, match=r"meta device.*to_empty.*load_weights"):
        pipe.step(x, target=x)
    with pytest.raises(pc.ConfigError, match="to_empty"):
        pipe.init_weights()


def test_to_empty_allocates_only_meta_tensors_and_keeps_objects():
    model = _meta_gpt()
    table = torch.arange(8.0, dtype=torch.float64)
    model.register_buffer("table", table)  # real, unused: keeps its values
    pipe = _compile(model)
    before = {n: p for n, p in pipe.named_parameters()}
    pipe.to_empty()
    after = dict(pipe.named_parameters())
    assert all(after[n] is p and not p.is_meta for n, p in before.items())
    assert model.wte.weight is pipe.wte.weight and not model.wte.weight.is_meta
    assert torch.equal(pipe.table, torch.arange(8.0, dtype=torch.float64))


def test_init_weights_do_not_depend_on_the_stage_count():
    torch.manual_seed(123)
    weights = []
    for devices in (1, 2, 4):
        pipe = _compile(_meta_gpt(), devices=devices)
        pipe.to_empty()
        torch.manual_seed(123)
        names = pipe.init_weights()
        assert "layers.0.attn.qkv" in names
        weights.append({k: v.clone() for k, v in pipe.state_dict().items()})
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        for k in weights[0]:
            assert torch.equal(weights[0][k], other[k]), k
    # the same seeding on the real model, then its training step equals the pipeline's
    torch.manual_seed(123)
    model = zoo.GPT(**SIZES).double()
    torch.manual_seed(123)
    init_weights(model, dict(model.state_dict(keep_vars=True)))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights[0].items())
    assert not torch.equal(weights[0]["layers.0.attn.qkv.weight"],
                           weights[0]["layers.1.attn.qkv.weight"])  # seeded per module name
    pipe = _compile(_meta_gpt(), devices=4)
    pipe.to_empty()
    torch.manual_seed(123)
    pipe.init_weights()
    x = _ids()
    loss = pipe.step(x, target=x)
    ref_loss, ref_grads = reference_step(model, (x,), {}, x, zoo.lm_loss, 4)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    assert_grads_equal(pipe, ref_grads)


def test_name_seed_is_stable():
    assert name_seed(0, "layers.0") == name_seed(0, "layers.0")
    assert name_seed(0, "layers.0") != name_seed(0, "layers.1")
    assert name_seed(0, "layers.0") != name_seed(1, "layers.0")
    assert 0 <= name_seed(7, "x") < 2**63


def test_load_weights_from_one_safetensors_file(tmp_path):
    real = zoo.GPT(**SIZES)  # float32 on disk, float64 in the pipeline: converted
    state = {k: v for k, v in real.state_dict().items() if k != "lm_head.weight"}  # tie once
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(tmp_path / "model.safetensors"))
    pipe = _compile(_meta_gpt())
    pipe.to_empty()
    result = pipe.load_weights(tmp_path / "model.safetensors")
    assert result.missing_keys == [] and result.unexpected_keys == ["extra.weight"]
    for k, v in real.state_dict().items():
        assert pipe.state_dict()[k].dtype == torch.float64
        assert torch.equal(pipe.state_dict()[k], v.double()), k
    x = _ids()
    ref_loss, ref_grads = reference_step(real.double(), (x,), {}, x, zoo.lm_loss, 4)
    assert abs(pipe.step(x, target=x).item() - ref_loss.item()) < 1e-12
    assert_grads_equal(pipe, ref_grads)


def test_load_weights_errors(tmp_path):
    pipe = _compile(_meta_gpt())
    with pytest.raises(pc.ConfigError, match="to_empty"):
        pipe.load_weights(tmp_path)
    pipe.to_empty()
    with pytest.raises(pc.CheckpointError, match="safetensors"):
        pipe.load_weights(tmp_path / "nothing-here")
    save_file({"wte.weight": torch.zeros(3, 16)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(pc.CheckpointError, match=r"'wte.weight'.*\[3, 16\].*\[64, 16\]"):
        pipe.load_weights(tmp_path / "bad.safetensors")
    with pytest.raises(pc.ConfigError, match="device"):
        pipe.to_empty(device="cpu")


def _small_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                      max_position_embeddings=16, use_cache=False, tie_word_embeddings=True,
                      **kw)
    return LlamaForCausalLM, cfg


def test_llama_from_meta_and_shards_equals_from_pretrained(tmp_path):
    cls, cfg = _small_llama()
    torch.manual_seed(0)
    cls(cfg).double().save_pretrained(tmp_path, max_shard_size="10KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ref = cls.from_pretrained(tmp_path, dtype=torch.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as from_pretrained(dtype=float64) builds it
    try:
        with meta_parameters():
            model = cls(cfg)
    finally:
        torch.set_default_dtype(default)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_meta
    assert not model.model.rotary_emb.inv_freq.is_meta  # buffers real
    ce = torch.nn.functional.cross_entropy

    def loss_fn(out, y):
        return ce(out.logits.reshape(-1, 64), y.reshape(-1))

    x = _ids()
    pipe = pc.compile(model, example_inputs=(x,), devices=2, loss_fn=loss_fn,
                      schedule="1f1b", microbatches=2)
    pipe.to_empty()
    result = pipe.load_weights(tmp_path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(pipe.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq,
                               rtol=0, atol=0)
    loss = pipe.step(x, target=x)
    ref_loss, ref_grads = reference_step(ref, (x,), {}, x, loss_fn, 2)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    assert len(assert_grads_equal(pipe, ref_grads)) == len(list(ref.parameters()))


class FusedQKV(torch.nn.Module):
    """A fused q/k/v projection saved as three weights, as torchtitan's Llama 3 does:
    `wqkv.weight` in the module, `wq`/`wk`/`wv` in its state_dict (hooks both ways)."""

    def __init__(self, dim: int):
        super().__init__()
        self.wqkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.out = torch.nn.Linear(dim, dim)
        self._register_state_dict_hook(FusedQKV._split)
        self._register_load_state_dict_pre_hook(FusedQKV._fuse)

    def forward(self, x):
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        return self.out(torch.tanh(q * k) + v)

    @staticmethod
    def _split(module, state, prefix, local_metadata):
        fused = state.pop(f"{prefix}wqkv.weight")
        for name, part in zip("qkv", fused.chunk(3, dim=0)):
            state[f"{prefix}w{name}"] = part

    @staticmethod
    def _fuse(state, prefix, *args):
        if f"{prefix}wq" in state:
            state[f"{prefix}wqkv.weight"] = torch.cat(
                [state.pop(f"{prefix}w{n}") for n in "qkv"], dim=0)


def _fused_model():
    return torch.nn.Sequential(FusedQKV(4), torch.nn.Tanh(), FusedQKV(4)).double()


def _mse(out, y):
    return (out - y).pow(2).mean()


@pytest.mark.parametrize("on_meta", [False, True])
def test_state_dict_hooks_rename_checkpoint_keys(tmp_path, on_meta):
    torch.manual_seed(0)
    real = _fused_model()
    keys = list(real.state_dict())
    assert "0.wq" in keys and "0.wqkv.weight" not in keys
    if on_meta:
        with torch.device("meta"):
            model = _fused_model()
    else:
        model = _fused_model()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = pc.compile(model, example_inputs=(x,), devices=2, loss_fn=_mse, schedule="gpipe",
                      microbatches=2, split_points=["1"])
    if on_meta:
        pipe.to_empty()
        save_file({k: v.contiguous() for k, v in real.state_dict().items()},
                  str(tmp_path / "w.safetensors"))
        result = pipe.load_weights(tmp_path / "w.safetensors")
        assert result.missing_keys == [] and result.unexpected_keys == []
    else:
        pipe.load_state_dict(real.state_dict())
    assert list(pipe.state_dict()) == keys
    for k, v in real.state_dict().items():
        assert torch.equal(pipe.state_dict()[k], v), k
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(real, (x,), {}, y, _mse, 2)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    assert_grads_equal(pipe, ref_grads)


def test_lazy_meta_model_plans_on_its_first_call_then_materialises():
    model = _meta_gpt()
    pipe = pc.compile(model, devices=2, loss_fn=zoo.lm_loss, schedule="gpipe", microbatches=2)
    x = _ids()
    with pytest.raises(pc.ConfigError, match="to_empty"):
        pipe.step(x, target=x)  # planned now, on meta
    assert pipe.planned and all(p.is_meta for p in pipe.parameters())
    pipe.to_empty()
    torch.manual_seed(0)
    pipe.init_weights()
    with pytest.raises(pc.ConfigError, match="to_empty"):
        pc.compile(_meta_gpt(), example_inputs=(x,), devices=2).save("unused")
    real = zoo.GPT(**SIZES).double()
    real.load_state_dict(pipe.state_dict())
    ref_loss, ref_grads = reference_step(real, (x,), {}, x, zoo.lm_loss, 2)
    assert abs(pipe.step(x, target=x).item() - ref_loss.item()) < 1e-12
    assert_grads_equal(pipe, ref_grads)


def test_load_weights_from_dcp_converting_bf16(tmp_path):
    import torch.distributed.checkpoint as dcp

    real = zoo.GPT(**SIZES).to(torch.bfloat16)
    dcp.save(real.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    pipe = _compile(_meta_gpt())
    pipe.to_empty()
    result = pipe.load_weights(tmp_path / "dcp")
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in real.state_dict().items():
        assert pipe.state_dict()[k].dtype == torch.float64
        assert torch.equal(pipe.state_dict()[k], v.double()), k


def test_init_weights_needs_fn_for_modules_without_reset_parameters():
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = torch.nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.gain

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(), torch.nn.Linear(4, 4))
    x = torch.randn(8, 4)
    pipe = pc.compile(model, example_inputs=(x,), devices=2, loss_fn=_mse, schedule="gpipe",
                      microbatches=2)
    pipe.to_empty()
    with pytest.raises(pc.ConfigError, match=r"'1' hold.*no reset_parameters.*fn="):
        pipe.init_weights()

    def ones(module):
        for p in module.parameters(recurse=False):
            torch.nn.init.ones_(p)

    assert pipe.init_weights(fn=ones) == ["0", "1", "2"]
    assert all(torch.equal(p, torch.ones_like(p)) for p in pipe.parameters())
