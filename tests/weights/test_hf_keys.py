"""pipecompile/weights/hf_keys.py and checkpoint_load.py on their own (no compile): transformers'
conversion mapping planned from a checkpoint's keys, run by transformers' converters, so that a
`save_pretrained` directory loads exactly as `from_pretrained` loads it, reading only the
sources of the tensors asked for; strictness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import pipecompile as pc
from pipecompile.weights import read as weights
from pipecompile.weights.load import load_weights
from pipecompile.weights.hf_keys import recipes, transforms
from pipecompile.mirror import mirror
from pipecompile.weights.read import checkpoint_keys

from tests.weights.test_read import _Recorder


def _mixtral(experts=4):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM, MixtralConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, vocab_size=64, max_position_embeddings=16,
        num_local_experts=experts, num_experts_per_tok=2, use_cache=False,
        tie_word_embeddings=False)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A tiny Mixtral saved by save_pretrained in several shards, and from_pretrained's model."""
    cls, cfg = _mixtral()
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("mixtral")
    cls(cfg).double().save_pretrained(out, max_shard_size="20KB")
    return cls, cfg, out, cls.from_pretrained(out, dtype=torch.float64)


def _random_like(model):
    """`model`'s keys over fresh random tensors (what the load must overwrite)."""
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.copy_(torch.randn(t.shape, dtype=torch.float64).to(t.dtype))
    return model


def _load(model, path, **kw):
    own = dict(model.state_dict(keep_vars=True))
    return load_weights(model, own, path, list(own), [], model=model, **kw)


def test_mixtral_experts_saved_one_by_one_load_fused_as_from_pretrained(mixtral):
    cls, cfg, path, ref = mixtral
    stored = checkpoint_keys(path)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in stored
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    model = _random_like(cls(cfg).double())
    plan = recipes(model, list(model.state_dict()), stored)
    fused = plan.by_target["model.layers.0.mlp.experts.gate_up_proj"]
    assert set(fused.sources) == {f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"
                                  for e in range(4) for w in ("w1", "w3")}
    assert plan.by_target["model.layers.1.mlp.gate.weight"].sources == (
        "model.layers.1.block_sparse_moe.gate.weight",)  # renamed
    assert plan.unexpected == ()
    result = _load(model, path)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # without transformers' conversion (a model that is not a PreTrainedModel): nothing fills
    bare = recipes(None, list(model.state_dict()), stored)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in bare.by_target
    assert len(bare.unexpected) == 2 * 4 * 3 + 2  # 2 layers x 4 experts x w1/w2/w3, routers
    with pytest.raises(pc.CheckpointError, match=r"lacks 6 key.*experts.down_proj.*"
                                                 r"fill no key of the model"):
        load_weights(model, dict(model.state_dict(keep_vars=True)), path,
                     list(model.state_dict()), [], model=None)


def test_a_checkpoint_already_in_the_models_keys_loads_unconverted(mixtral, tmp_path):
    """pipe.state_dict() saved (a DCP or safetensors checkpoint of the fused model): no
    renaming of transformers' mapping applies to keys the model already has."""
    cls, cfg, _, ref = mixtral
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()},
              str(tmp_path / "fused.safetensors"))
    model = _random_like(cls(cfg).double())
    assert _load(model, tmp_path / "fused.safetensors").unexpected_keys == []
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_process_reads_only_the_sources_of_its_own_tensors(mixtral, monkeypatch):
    cls, cfg, path, ref = mixtral
    model = cls(cfg).double()
    keys = list(model.state_dict())
    mine = {k: torch.zeros_like(v) for k, v in model.state_dict().items()
            if k.startswith("model.layers.1.")}  # one stage: the second layer
    root = torch.nn.Module()
    mirror(root, ((k, torch.nn.Parameter(v), True) for k, v in mine.items()))
    recorder = _Recorder(weights.safe_open)
    monkeypatch.setattr(weights, "safe_open", recorder)
    result = load_weights(root, dict(root.state_dict(keep_vars=True)), path, keys, [],
                          model=model)
    assert result.missing_keys == []
    # its experts' N per-expert tensors and nothing of layer 0, the embedding or the head
    assert sorted(recorder.read) == sorted(k for k in checkpoint_keys(path)
                                           if k.startswith("model.layers.1."))
    for key, value in root.state_dict().items():
        assert torch.equal(value, ref.state_dict()[key]), key


def test_strict_names_a_missing_key_and_strict_false_returns_it(mixtral, tmp_path):
    cls, cfg, path, ref = mixtral
    state = {k: v for f in sorted(Path(path).glob("model-*.safetensors"))
             for k, v in load_file(str(f)).items()}
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"},
              str(tmp_path / "no-norm.safetensors"))
    model = cls(cfg).double()
    with pytest.raises(pc.CheckpointError,
                       match=r"lacks 1 key.*\['model.norm.weight'\].*strict=False"):
        _load(model, tmp_path / "no-norm.safetensors")
    result = _load(model, tmp_path / "no-norm.safetensors", strict=False)
    assert result.missing_keys == ["model.norm.weight"]
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj,
                       ref.model.layers[1].mlp.experts.gate_up_proj)
    # one expert of four absent: the fused tensor cannot be made, whatever `strict` says
    lost = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    save_file({k: v for k, v in state.items() if k != lost},
              str(tmp_path / "no-expert.safetensors"))
    with pytest.raises(pc.CheckpointError, match=r"made 'model.layers.1.mlp.experts.down_proj' "
                                                 r"of shape \[3, 16, 32\] from 3 checkpoint "
                                                 r"tensors.*\[4, 16, 32\]"):
        _load(model, tmp_path / "no-expert.safetensors", strict=False)


def test_vit_saved_under_its_legacy_names_loads_as_from_pretrained(tmp_path):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=32, image_size=8, patch_size=4, num_labels=3)
    torch.manual_seed(0)
    ViTForImageClassification(cfg).save_pretrained(tmp_path)
    stored = checkpoint_keys(tmp_path)
    assert "vit.encoder.layer.0.attention.attention.query.weight" in stored
    ref = ViTForImageClassification.from_pretrained(tmp_path)
    model = _random_like(ViTForImageClassification(cfg))
    assert "vit.layers.0.attention.q_proj.weight" in model.state_dict()
    result = _load(model, tmp_path)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_bert_legacy_gamma_beta_names_load_and_plain_models_get_no_transforms(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, vocab_size=64, max_position_embeddings=16,
                     tie_word_embeddings=False)
    torch.manual_seed(0)
    BertForMaskedLM(cfg).save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma")
              .replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in saved.items()}
    assert sum(".gamma" in k for k in legacy) == 6
    save_file(legacy, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ref = BertForMaskedLM.from_pretrained(tmp_path)
    model = _random_like(BertForMaskedLM(cfg))
    result = _load(model, tmp_path)
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    assert transforms(torch.nn.Linear(2, 2)) == [] and transforms(None) == []
