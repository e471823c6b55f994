"""Real model families from transformers, built as their users build them, for the sweep in
tests/integration/test_real_models.py.

Each `Family` builds a tiny config with random weights (nothing is downloaded: hidden 16,
1 or 2 layers per stack, vocab 96, sequence 8, batch 4) in float64, dropout 0, `use_cache=False`,
and gives the batch its users train on: the inputs plus `labels=` (or `return_loss=True`), so
that the model computes its own loss (`own_loss`: `out.loss`). The CTC models are the
exception: their loss cannot be captured, and transformers' own `ForCTCLoss` runs as `loss_fn`
(see `ctc_loss`, `parakeet_ctc_loss`).

`meta=True` families (the language models, causal and masked) are trained the README's "Models
bigger than one process" way: built under `torch.device("meta")`, loaded with
`pipe.to_empty(); pipe.load_weights(dir)` from a `save_pretrained` directory of small shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

BATCH = 4
SEQ = 8
VOCAB = 96
LAYERS = 2  # per stack: enough blocks for 4 stages; capture and costing grow with depth


@dataclass(frozen=True)
class Family:
    """One model family: `build()` the model (float64, train mode), its `batch()` (positional
    args, keyword args incl. labels) and the loss its users train with."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[], tuple[tuple, dict[str, Any]]]
    meta: bool = False  # built on meta and loaded from save_pretrained shards
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None  # None: the model's own loss
    target: Callable[[], Any] | None = None  # the target loss_fn is given (None: no target)
    options: tuple[tuple[str, Any], ...] = ()  # more compile() options


def own_loss(out: Any, _target: Any) -> torch.Tensor:
    """The model's own loss (computed from `labels=` inside its forward)."""
    return out.loss


def _gen(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(seq: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, seq), generator=_gen(seed))


def _float(*shape: int, seed: int = 2) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def _padding_mask() -> torch.Tensor:
    """Attention mask with right padding on two rows (as a tokenizer pads a batch)."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 6:] = 0
    mask[3, 5:] = 0
    return mask


# -- language models: built on meta, loaded from shards -------------------------------------

def lm_batch() -> tuple[tuple, dict[str, Any]]:
    """Token ids and the same ids as labels (the model shifts them)."""
    ids = _ids()
    return (ids,), {"labels": ids}


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=LAYERS, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=VOCAB,
                      max_position_embeddings=16, use_cache=False, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=VOCAB,
                      max_position_embeddings=16, use_cache=False, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def _mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=16, vocab_size=VOCAB,
                        max_position_embeddings=16, num_local_experts=4,
                        num_experts_per_tok=2, use_cache=False, router_aux_loss_coef=0.02,
                        output_router_logits=True, experts_implementation="batched_mm")
    return MixtralForCausalLM(cfg)  # batched_mm: the default grouped_mm refuses float64


def _bert_mlm() -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                     intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)


def _bert_mlm_batch() -> tuple[tuple, dict[str, Any]]:
    ids = _ids()
    masked = torch.rand(BATCH, SEQ, generator=_gen(3)) < 0.4
    masked[:, 0] = True  # at least one masked token per row
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 2), ids)  # 2: the [MASK] id here
    return (inputs,), {"attention_mask": torch.ones_like(ids), "labels": labels}


# -- classification, seq2seq, vision, audio, contrastive: built eagerly ---------------------

def _roberta_cls() -> torch.nn.Module:
    from transformers import RobertaConfig, RobertaForSequenceClassification

    cfg = RobertaConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                        intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=16,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        classifier_dropout=0.0, num_labels=3, pad_token_id=1)
    return RobertaForSequenceClassification(cfg)


def _cls_batch() -> tuple[tuple, dict[str, Any]]:
    mask = _padding_mask()
    ids = torch.where(mask.bool(), _ids(), torch.ones_like(mask))  # 1: the pad id
    labels = torch.randint(0, 3, (BATCH,), generator=_gen(4))
    return (ids,), {"attention_mask": mask, "labels": labels}


def _seq2seq_batch() -> tuple[tuple, dict[str, Any]]:
    """Source ids and the target's ids as labels (the decoder's inputs are the labels shifted
    right, inside the model)."""
    return (_ids(),), {"labels": _ids(seq=6, seed=5)}


def _bart() -> torch.nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(d_model=16, encoder_layers=LAYERS, decoder_layers=LAYERS,
                     encoder_attention_heads=2, decoder_attention_heads=2,
                     encoder_ffn_dim=32, decoder_ffn_dim=32,
                     vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    return BartForConditionalGeneration(cfg)


def _vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                    intermediate_size=32, image_size=8, patch_size=4, num_labels=5,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def _vit_batch() -> tuple[tuple, dict[str, Any]]:
    return (_float(BATCH, 3, 8, 8),), {"labels": torch.randint(0, 5, (BATCH,), generator=_gen(4))}


def _whisper() -> torch.nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1,  # BART has 2 + 2
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=32, decoder_ffn_dim=32, vocab_size=VOCAB,
                        num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                        use_cache=False, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=0)
    return WhisperForConditionalGeneration(cfg)


def _whisper_batch() -> tuple[tuple, dict[str, Any]]:
    # log-mel features (batch, mel bins, 2 * max_source_positions) and the transcript's ids
    return (_float(BATCH, 8, 16),), {"labels": _ids(seq=6, seed=5)}


def _wav2vec2_ctc() -> torch.nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                         intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2),
                         conv_kernel=(8, 4), num_conv_pos_embeddings=4,
                         num_conv_pos_embedding_groups=2, vocab_size=12,
                         hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
                         mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0)
    return Wav2Vec2ForCTC(cfg)


def _wav2vec2_batch() -> tuple[tuple, dict[str, Any]]:
    # 64 samples of "audio" -> 15 -> 6 frames of logits
    return (_float(BATCH, 64),), {}


def _wav2vec2_labels() -> torch.Tensor:
    """3 or 4 characters per clip, padded with -100 as transformers' CTC collators pad."""
    labels = torch.randint(1, 12, (BATCH, 4), generator=_gen(6))
    labels[1, 3:] = -100
    labels[3, 3:] = -100
    return labels


def ctc_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Wav2Vec2ForCTC's own loss (transformers' `ForCTCLoss`, as its forward calls it without an
    attention mask), computed outside the model: `model(x, labels=...)` cannot be captured, its
    forward starts with the data-dependent `if labels.max() >= vocab_size: raise`."""
    from transformers.loss.loss_ctc import ForCTCLoss

    frames = torch.full((out.logits.shape[0],), out.logits.shape[1], dtype=torch.long)
    return ForCTCLoss(logits=out.logits, labels=labels, logit_lengths=frames, blank_token_id=0,
                      reduction="mean")


def _parakeet_ctc() -> torch.nn.Module:
    from transformers import ParakeetCTCConfig, ParakeetForCTC

    encoder = dict(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                   intermediate_size=32, conv_kernel_size=3, subsampling_factor=4,
                   subsampling_conv_channels=4, num_mel_bins=8, max_position_embeddings=64,
                   dropout=0.0, dropout_positions=0.0, layerdrop=0.0, activation_dropout=0.0,
                   attention_dropout=0.0)
    return ParakeetForCTC(ParakeetCTCConfig(vocab_size=12, pad_token_id=11,
                                            encoder_config=encoder))


def _parakeet_batch() -> tuple[tuple, dict[str, Any]]:
    # 32 frames of 8 log-mel bins -> 8 frames of logits; no padding (the attention mask the
    # processor gives is all ones)
    return (_float(BATCH, 32, 8),), {"attention_mask": torch.ones(BATCH, 32, dtype=torch.long)}


def _parakeet_labels() -> torch.Tensor:
    """3 or 4 tokens per clip (11, the pad id, is the blank), padded with -100."""
    labels = torch.randint(0, 11, (BATCH, 4), generator=_gen(6))
    labels[1, 3:] = -100
    labels[3, 3:] = -100
    return labels


def parakeet_ctc_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """ParakeetForCTC's own loss (`ForCTCLoss` as its forward calls it, every frame valid),
    computed outside the model: `F.ctc_loss` with tensor lengths cannot be exported."""
    from transformers.loss.loss_ctc import ForCTCLoss

    frames = torch.full((out.logits.shape[0],), out.logits.shape[1], dtype=torch.long)
    return ForCTCLoss(logits=out.logits, labels=labels, logit_lengths=frames, blank_token_id=11,
                      reduction="mean", zero_infinity=True)


# -- models that capture keeps partly opaque or prices by estimate ---------------------------

def _gemma3n() -> torch.nn.Module:
    """Gemma3n's text model: its AltUp clamps a weight through `.data` in train mode, in a
    method the decoder layer calls (capture keeps the decoder layers opaque)."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    cfg = Gemma3nTextConfig(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=16,
                            intermediate_size=32, num_hidden_layers=LAYERS,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            max_position_embeddings=16, hidden_size_per_layer_input=8,
                            laurel_rank=4, num_kv_shared_layers=0, altup_num_inputs=2,
                            sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                            use_cache=False)
    return Gemma3nForCausalLM(cfg)


def _jetmoe() -> torch.nn.Module:
    """JetMoE: its experts split the tokens by `counts.tolist()` (data-dependent sizes)."""
    from transformers import JetMoeConfig, JetMoeForCausalLM

    cfg = JetMoeConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=LAYERS,
                       num_key_value_heads=2, kv_channels=4, intermediate_size=16,
                       max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                       use_cache=False, attention_dropout=0.0)
    return JetMoeForCausalLM(cfg)


def phimoe() -> torch.nn.Module:
    """PhiMoE with its jitter on: random ops inside its routers (kept opaque: a custom
    autograd.Function) and around them."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    cfg = PhimoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                       num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
                       input_jitter_noise=0.01, router_jitter_noise=0.01, attention_dropout=0.0,
                       use_cache=False, experts_implementation="batched_mm")
    return PhimoeForCausalLM(cfg)


def _clip() -> torch.nn.Module:
    from transformers import CLIPConfig, CLIPModel

    text = dict(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=SEQ,
                attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2,
                  intermediate_size=32, image_size=8, patch_size=4, attention_dropout=0.0)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def _clip_batch() -> tuple[tuple, dict[str, Any]]:
    ids = _ids()
    ids[:, -1] = 2  # each caption ends with its end-of-text token (the pooled position)
    return (ids, _float(BATCH, 3, 8, 8)), {"return_loss": True}


FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("gpt2", _gpt2, lm_batch, meta=True),
    Family("llama", _llama, lm_batch, meta=True),
    Family("qwen2", _qwen2, lm_batch, meta=True),
    # the router loss branches on `device.type` (histc's dtype): a meta build must be
    # captured on fakes claiming the stage device to take the CPU path
    Family("mixtral", _mixtral, lm_batch, meta=True),
    Family("bert_mlm", _bert_mlm, _bert_mlm_batch, meta=True),
    Family("roberta_cls", _roberta_cls, _cls_batch),
    Family("bart", _bart, _seq2seq_batch),
    Family("vit", _vit, _vit_batch),
    Family("whisper", _whisper, _whisper_batch),
    Family("wav2vec2_ctc", _wav2vec2_ctc, _wav2vec2_batch, loss_fn=ctc_loss,
           target=_wav2vec2_labels),
    Family("clip", _clip, _clip_batch),
    # fixed-length batches: only the batch symbolic (a faster capture)
    Family("gemma3n", _gemma3n, lm_batch, options=(("symbolic_sizes", "batch"),)),
    Family("jetmoe", _jetmoe, lm_batch, options=(("symbolic_sizes", "batch"),)),
    Family("parakeet_ctc", _parakeet_ctc, _parakeet_batch, loss_fn=parakeet_ctc_loss,
           target=_parakeet_labels, options=(("symbolic_sizes", "batch"),)),
]}
