"""The Zero Bubble paper's GPT as the kernels Megatron-LM ran it, for planning on meta.

Not a benchmark. `bench/published.py` predicts the Zero Bubble paper's runs (Qi et al., ICLR
2024) from this model. It is transformers' GPT-2 at the paper's sizes (Table 3), with two
changes so that each op is the kernel Megatron-LM ran. The paper's script of the time
(sail-sg/zero-bubble-pipeline-parallelism, examples/pretrain_zero_bubble.sh at 425b42e,
2023-11-17) passes no `--use-flash-attn`, and Megatron-LM's own default that autumn is
`use_flash_attn=False`, `masked_softmax_fusion=True`, `bias_gelu_fusion=True`
(megatron/arguments.py at that commit), so:

- attention is Megatron's "local" CoreAttention, not FlashAttention: a batched GEMM writes
  the b x heads x s x s scores (`torch.baddbmm`, the 1/sqrt(d) scale as its alpha), one
  fused kernel applies the scale, the causal mask and the softmax
  (`scaled_upper_triang_masked_softmax`; here `torch.softmax`, one kernel that reads and
  writes the scores as that one does: the mask is computed inside it, never read), dropout
  0.1 over the probabilities, and a second batched GEMM with the values. Every one of them
  moves the s x s scores through HBM, forward and backward;
- the MLP's GELU is one fused kernel (`bias_gelu`, the tanh form): GPT-2's
  `gelu_pytorch_tanh`, one kernel, where its default `gelu_new` is eight elementwise ones.

The model only prices: its softmax omits the causal mask, which Megatron's kernel applies at
no extra traffic, so it must not be run for values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["megatron_gpt", "ATTENTION"]

#: The name the local attention is registered under in transformers' AttentionInterface.
ATTENTION = "megatron_local"


def _local_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """Megatron-LM's CoreAttention without FlashAttention (module docstring): [b, h, s, d]
    in, [b, s, h, d] out, as transformers' attention functions return."""
    b, h, s, d = query.shape
    q = query.reshape(b * h, s, d)
    k = key.reshape(b * h, key.shape[-2], d)
    v = value.reshape(b * h, value.shape[-2], d)
    buffer = torch.empty(b * h, s, k.shape[1], dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(buffer, q, k.transpose(1, 2), beta=0.0,
                           alpha=scaling if scaling is not None else d ** -0.5)
    probs = torch.softmax(scores, dim=-1)  # stands for the fused scale-mask-softmax kernel
    probs = F.dropout(probs, p=dropout, training=module.training)
    out = torch.bmm(probs, v).view(b, h, s, d).transpose(1, 2)
    return out, None


def megatron_gpt(layers: int, hidden: int, heads: int, batch: int, *, seq: int = 1024,
                 vocab: int = 32000, tied: bool = True):
    """(model, args, kwargs): the GPT of `layers` x `hidden` with `heads`, bfloat16 on meta,
    a batch of `batch` sequences of `seq` tokens with labels; Megatron's kernels (module
    docstring)."""
    from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel

    AttentionInterface.register(ATTENTION, _local_attention)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=seq,
                        vocab_size=vocab, bos_token_id=0, eos_token_id=0, use_cache=False,
                        tie_word_embeddings=tied, activation_function="gelu_pytorch_tanh")
    config._attn_implementation = ATTENTION
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}
