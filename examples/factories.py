"""Model factories for the `pipecompile` command: each returns (model, example_inputs) or
(model, example_inputs, example_kwargs).

    pipecompile inspect examples/factories.py:gpt2 --devices 4
    pipecompile plan    examples/factories.py:gpt --devices 4 --schedule 1f1b --microbatches 8
    pipecompile export  examples/factories.py:gpt2 --devices 2 --onnx out/gpt2
"""

import torch

from pipecompile import zoo

BATCH, SEQ, VOCAB = 8, 32, 256


def gpt2():
    """A small GPT-2 (transformers GPT2LMHeadModel, random weights, no KV cache)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    return model, (torch.randint(0, VOCAB, (BATCH, SEQ)),)


def gpt(batch=BATCH):
    """pipecompile.zoo.GPT: a nanoGPT-style decoder with a tied embedding and LM head."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=VOCAB, dim=64, layers=4, heads=4, seq=SEQ)
    return model, (torch.randint(0, VOCAB, (batch, SEQ)),)


def keyword_tuple():
    """A model with a keyword input and a tuple output: (model, inputs, kwargs)."""
    torch.manual_seed(0)
    model = zoo.KeywordTupleModel(dim=6, hidden=8, layers=4)
    return model, (torch.randn(BATCH, 6),), {"scale": torch.rand(BATCH, 1) + 0.5}


def llama3_70b(layers=80, batch=32, seq=4096):
    """A Llama-3-70B-shaped transformers LlamaForCausalLM on the meta device (no weights are
    allocated): hidden 8192, MLP 28672, 64 heads with 8 KV heads, vocab 128256, bfloat16,
    untied embeddings, no KV cache; `layers` of them (80 in Llama 3 70B). The example batch
    (token ids, and the same as labels so that the model computes its own loss) is on meta too.
    Plan it for hardware that is not here; nothing runs:

        pipecompile plan examples/factories.py:llama3_70b --devices 32 --device h100
        pipecompile plan examples/factories.py:llama3_70b --arg layers=8 --devices 8 --device h100
    """
    return _llama3_on_meta(layers, hidden=8192, mlp=28672, heads=64, batch=batch, seq=seq)


def llama3_8b(layers=32, batch=8, seq=8192):
    """A Llama-3-8B-shaped transformers LlamaForCausalLM on the meta device: hidden 4096, MLP
    14336, 32 heads with 8 KV heads, vocab 128256, bfloat16, untied embeddings; `layers` of
    them (32 in Llama 3 8B). Token ids and labels of `batch` x `seq` on meta:

        pipecompile plan examples/factories.py:llama3_8b --device h100 --nodes 1 --per-node 8
    """
    return _llama3_on_meta(layers, hidden=4096, mlp=14336, heads=32, batch=batch, seq=seq)


def _llama3_on_meta(layers, *, hidden, mlp, heads, batch, seq):
    """A Llama-3-shaped LlamaForCausalLM (8 KV heads, vocab 128256, bfloat16, untied, no KV
    cache) and token ids = labels of `batch` x `seq`, all on the meta device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=mlp,
        num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, use_cache=False, torch_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}
