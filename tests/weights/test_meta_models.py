"""Models built on the meta device: compiled without weights, then materialised, initialised
or loaded per process (pipecompile/weights/materialize.py), compared with the eager model in float64."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch.utils.weak import WeakIdKeyDictionary

import pipecompile as pc
from pipecompile import zoo
from pipecompile.weights.materialize import init_weights, meta_parameters, name_seed

from tests.support.reference import assert_grads_equal, reference_step

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


def test_to_empty_forgets_weak_memos_with_a_dead_weak_proxy_on_the_heap():
    """to_empty scans the heap for torch's weak memos of the meta tensors (swap_tensors refuses
    a weakly referenced tensor); a dead `weakref.proxy` elsewhere on the heap must not stop it
    (`isinstance` on one raises ReferenceError: CI failed on it once)."""
    pipe = _compile(_meta_gpt())
    memo = WeakIdKeyDictionary()
    memo[pipe.wte.weight] = "fake"
    referent = type("Referent", (), {})()
    dead = [weakref.proxy(referent)]
    del referent
    with pytest.raises(ReferenceError):
        isinstance(dead[0], WeakIdKeyDictionary)
    pipe.to_empty()
    assert not pipe.wte.weight.is_meta and len(memo) == 0

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


def test_load_weights_is_strict_and_a_step_refuses_what_nothing_wrote(tmp_path):
    real = zoo.GPT(**SIZES).double()
    state = {k: v for k, v in real.state_dict().items() if k != "lm_head.weight"}  # tie once
    lost = "layers.2.mlp.fc.bias"
    save_file({k: v for k, v in state.items() if k != lost}, str(tmp_path / "part.safetensors"))
    pipe = _compile(_meta_gpt())
    pipe.to_empty()
    with pytest.raises(pc.CheckpointError, match=r"lacks 1 key.*\['layers.2.mlp.fc.bias'\].*"
                                                 r"strict=False"):
        pipe.load_weights(tmp_path / "part.safetensors")
    result = pipe.load_weights(tmp_path / "part.safetensors", strict=False)
    assert result.missing_keys == [lost] and result.unexpected_keys == []
    x = _ids()
    with pytest.raises(pc.ConfigError, match=r"pipe.step\(\): 1 tensor.*to_empty.*"
                                             r"\['layers.2.mlp.fc.bias'\].*neither loaded"):
        pipe.step(x, target=x)
    for where, call in (("pipe.save", lambda: pipe.save(tmp_path / "plan")),
                        ("pipe.export_onnx", lambda: pipe.export_onnx(str(tmp_path / "onnx")))):
        with pytest.raises(pc.ConfigError, match=where + r".*layers.2.mlp.fc.bias"):
            call()  # nor written out with never-written memory
    pipe.load_state_dict({lost: state[lost]}, strict=False)  # written now: the step runs
    ref_loss, ref_grads = reference_step(real, (x,), {}, x, zoo.lm_loss, 4)
    assert abs(pipe.step(x, target=x).item() - ref_loss.item()) < 1e-12
    assert_grads_equal(pipe, ref_grads)


class _Buffered(torch.nn.Module):
    """Linear layers, a BatchNorm without parameters (buffers its reset_parameters resets), a
    persistent buffer and a non-persistent one that no reset_parameters() writes."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4, affine=False)
        self.register_buffer("shift", torch.full((4,), 0.5))
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x)))) * self.scale + self.shift


def test_init_weights_leaves_nothing_uninitialised():
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)

    def fresh():
        with torch.device("meta"):
            model = _Buffered().double()
        pipe = pc.compile(model, example_inputs=(x,), devices=2, loss_fn=_mse,
                          schedule="gpipe", microbatches=2)
        pipe.to_empty()
        return pipe

    pipe = fresh()
    assert pipe.init_weights() == ["a", "b", "norm"]  # BatchNorm: its running statistics
    assert torch.equal(pipe.norm.running_var, torch.ones(4, dtype=torch.float64))
    with pytest.raises(pc.ConfigError, match=r"2 tensor.*non-persistent buffer\(s\) "
                                             r"\['scale'\].*meta_parameters.*\['shift'\] "
                                             r"were neither loaded nor initialised"):
        pipe.step(x, target=y)

    def linears_only(module):  # writes parameters, not buffers
        for p in module.parameters(recurse=False):
            torch.nn.init.normal_(p)

    pipe = fresh()
    pipe.init_weights(fn=linears_only)
    with pytest.raises(pc.ConfigError, match=r"\['norm.num_batches_tracked', "
                                             r"'norm.running_mean', 'norm.running_var'"):
        pipe.step(x, target=y)

    def everything(module):  # what a model's own init function does: its buffers too
        for p in module.parameters(recurse=False):
            torch.nn.init.normal_(p)
        for name, b in module.named_buffers(recurse=False):
            b.data.copy_(_Buffered().double().get_buffer(name) if name in ("scale", "shift")
                         else torch.nn.BatchNorm1d(4).double().get_buffer(name))

    pipe = fresh()
    assert pipe.init_weights(fn=everything) == ["", "a", "b", "norm"]
    real = _Buffered().double()
    real.load_state_dict(pipe.state_dict())
    ref_loss, ref_grads = reference_step(real, (x,), {}, y, _mse, 2)
    assert abs(pipe.step(x, target=y).item() - ref_loss.item()) < 1e-12
    assert_grads_equal(pipe, ref_grads)


def _small_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                      max_position_embeddings=16, use_cache=False, tie_word_embeddings=True,
                      **kw)
    return LlamaForCausalLM, cfg


def _build(cls, cfg, build):
    """`cls(cfg)` in float64 (as from_pretrained(dtype=float64) builds it) the README's two
    ways: `torch.device("meta")` (buffers on meta too) or `meta_parameters()` (buffers real)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with meta_parameters() if build == "meta_parameters" else torch.device("meta"):
            return cls(cfg)
    finally:
        torch.set_default_dtype(default)


def _logits_loss(out, y):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                             y.reshape(-1))


def _every_tensor(module):
    """Every parameter and buffer by name, non-persistent buffers (in no checkpoint) too."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _loads_as_from_pretrained(model, ref, path, *, on_empty=None):
    """Compile `model` (built on meta) at 2 stages, to_empty, load_weights(path): every
    tensor equals `ref`'s (from_pretrained(path)), and a step its loss and gradients."""
    x = _ids()
    pipe = pc.compile(model, example_inputs=(x,), devices=2, loss_fn=_logits_loss,
                      schedule="1f1b", microbatches=2)
    pipe.to_empty()
    if on_empty is not None:
        on_empty(pipe)
    result = pipe.load_weights(path)
    assert result.missing_keys == [] and result.unexpected_keys == []
    mine, theirs = _every_tensor(pipe), _every_tensor(ref)
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():  # a recomputed buffer may be kept in float64
        assert torch.equal(mine[key].detach().to(value.dtype), value.detach()), key
    loss = pipe.step(x, target=x)
    ref_loss, ref_grads = reference_step(ref, (x,), {}, x, _logits_loss, 2)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    assert len(assert_grads_equal(pipe, ref_grads)) == len(list(ref.parameters()))
    return pipe


@pytest.mark.parametrize("build", ["meta_parameters", "device"])
def test_llama_from_meta_and_shards_equals_from_pretrained(tmp_path, build):
    cls, cfg = _small_llama()
    torch.manual_seed(0)
    cls(cfg).double().save_pretrained(tmp_path, max_shard_size="10KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ref = cls.from_pretrained(tmp_path, dtype=torch.float64)
    model = _build(cls, cfg, build)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_meta
    # torch.device("meta") puts the rotary inv_freq (non-persistent: in no checkpoint) on meta
    assert model.model.rotary_emb.inv_freq.is_meta == (build == "device")

    def recomputed(pipe):  # by transformers' own _init_weights, before anything is loaded
        assert torch.equal(pipe.model.rotary_emb.inv_freq.float(),
                           ref.model.rotary_emb.inv_freq)

    _loads_as_from_pretrained(model, ref, tmp_path, on_empty=recomputed)


def test_mixtral_experts_saved_one_by_one_load_fused_as_from_pretrained(tmp_path):
    """transformers 5 saves a Mixtral's experts one by one (`block_sparse_moe.experts.N.w1`)
    and holds them fused (`mlp.experts.gate_up_proj`): its conversion mapping applies.

    batched_mm experts: the default grouped_mm picks its histc input dtype by device type, and
    traced on meta it takes the non-CPU branch (an int histc, which CPU lacks)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                        max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                        use_cache=False, tie_word_embeddings=False,
                        experts_implementation="batched_mm")
    torch.manual_seed(0)
    MixtralForCausalLM(cfg).double().save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    ref = MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float64,
                                             experts_implementation="batched_mm")
    _loads_as_from_pretrained(_build(MixtralForCausalLM, cfg, "device"), ref, tmp_path)


def test_bert_on_meta_recomputes_its_int_buffers_and_loads_legacy_names(tmp_path):
    """BERT's `position_ids` and `token_type_ids` are non-persistent int buffers (garbage
    indices after torch.device("meta") and to_empty); its checkpoint here has the legacy
    `LayerNorm.gamma`/`beta` names transformers still renames on load."""
    from safetensors.torch import load_file
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, vocab_size=64, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    BertForMaskedLM(cfg).double().save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    save_file({k.replace("LayerNorm.weight", "LayerNorm.gamma")
               .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in saved.items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref = BertForMaskedLM.from_pretrained(tmp_path, dtype=torch.float64)
    model = _build(BertForMaskedLM, cfg, "device")
    assert model.bert.embeddings.position_ids.is_meta

    def recomputed(pipe):
        assert torch.equal(pipe.bert.embeddings.position_ids, torch.arange(16)[None])
        assert torch.equal(pipe.bert.embeddings.token_type_ids, torch.zeros(1, 16).long())

    _loads_as_from_pretrained(model, ref, tmp_path, on_empty=recomputed)


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


class _DeviceBranch(torch.nn.Module):
    """Python that branches on where a tensor lives (transformers' MoE router loss picks
    histc's dtype by `device.type`)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.device.type == "cpu":
            h = h * 2
        return self.b(h)


@pytest.mark.parametrize("build", ["meta_parameters", "device"])
def test_a_meta_models_device_branches_follow_the_stage_device(tmp_path, build):
    torch.manual_seed(0)
    real = _DeviceBranch().double()
    save_file(real.state_dict(), str(tmp_path / "model.safetensors"))
    with meta_parameters() if build == "meta_parameters" else torch.device("meta"):
        meta = _DeviceBranch().double()
    x = torch.randn(4, 4, dtype=torch.float64)
    pipe = pc.compile(meta, (x,), devices=2, microbatches=2, schedule="1f1b", loss_fn=_mse)
    pipe.to_empty()
    pipe.load_weights(tmp_path / "model.safetensors")
    y = torch.zeros(4, 4, dtype=torch.float64)
    ref_loss, _ = reference_step(real, (x,), {}, y, _mse, 2)
    assert abs(pipe.step(x, target=y).item() - ref_loss.item()) < 1e-12
