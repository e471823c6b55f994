"""Test models: each factory returns a `Case` (model, inputs, kwargs, target, loss_fn) in float64.

transformers models are built from small configs with random weights (nothing is downloaded),
`use_cache=False` and dropout 0 so that a pipelined run is comparable with the unsplit model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipecompile import zoo

BATCH = 8


@dataclass
class Case:
    model: torch.nn.Module
    args: tuple
    target: Any
    loss_fn: Callable
    kwargs: dict = field(default_factory=dict)


def _ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _ids(vocab=64, seq=8, batch=BATCH):
    return torch.randint(0, vocab, (batch, seq))


def gpt() -> Case:
    model = zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8).double()
    return Case(model, (_ids(),), _ids(), zoo.lm_loss)


def gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).double()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return Case(model, (_ids(),), _ids(), lambda out, y: _ce(out.logits, y))


def bert() -> Case:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                     intermediate_size=32, vocab_size=64, max_position_embeddings=16,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(cfg).double()
    target = torch.randn(BATCH, 8, 16, dtype=torch.float64)
    return Case(model, (_ids(),), target,
                lambda out, y: F.mse_loss(out.last_hidden_state, y) + out.pooler_output.pow(2).mean())


def llama() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, vocab_size=64,
                      max_position_embeddings=16, use_cache=False)
    model = LlamaForCausalLM(cfg).double()
    return Case(model, (_ids(),), _ids(), lambda out, y: _ce(out.logits, y))


def t5() -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2,
                   vocab_size=64, use_cache=False, dropout_rate=0.0)
    model = T5ForConditionalGeneration(cfg).double()
    return Case(model, (_ids(),), _ids(seq=6), lambda out, y: _ce(out.logits, y),
                kwargs={"decoder_input_ids": _ids(seq=6)})


def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                    intermediate_size=32, image_size=8, patch_size=4, num_labels=5,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = ViTForImageClassification(cfg).double()
    return Case(model, (torch.randn(BATCH, 3, 8, 8, dtype=torch.float64),),
                torch.randint(0, 5, (BATCH,)), lambda out, y: F.cross_entropy(out.logits, y))


def unet() -> Case:
    model = zoo.UNet(channels=3, width=4, classes=2).double()
    x = torch.randn(BATCH, 3, 8, 8, dtype=torch.float64)
    return Case(model, (x,), torch.randint(0, 2, (BATCH, 8, 8)),
                lambda out, y: F.cross_entropy(out, y))


def residual_cnn() -> Case:
    model = zoo.ResidualCNN(width=4, blocks=4, classes=3).double()
    x = torch.randn(BATCH, 3, 6, 6, dtype=torch.float64)
    return Case(model, (x,), torch.randint(0, 3, (BATCH,)), F.cross_entropy)


def keyword_tuple() -> Case:
    model = zoo.KeywordTupleModel(dim=6, hidden=8, layers=4).double()
    x = torch.randn(BATCH, 6, dtype=torch.float64)
    scale = torch.rand(BATCH, 1, dtype=torch.float64) + 0.5
    return Case(model, (x,), torch.randn(BATCH, 6, dtype=torch.float64), zoo.tuple_loss,
                kwargs={"scale": scale})


CASES: dict[str, Callable[[], Case]] = {
    "gpt": gpt, "gpt2": gpt2, "bert": bert, "llama": llama, "t5": t5, "vit": vit,
    "unet": unet, "residual_cnn": residual_cnn, "keyword_tuple": keyword_tuple,
}
