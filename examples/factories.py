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


def gpt():
    """pipecompile.zoo.GPT: a nanoGPT-style decoder with a tied embedding and LM head."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=VOCAB, dim=64, layers=4, heads=4, seq=SEQ)
    return model, (torch.randint(0, VOCAB, (BATCH, SEQ)),)


def keyword_tuple():
    """A model with a keyword input and a tuple output: (model, inputs, kwargs)."""
    torch.manual_seed(0)
    model = zoo.KeywordTupleModel(dim=6, hidden=8, layers=4)
    return model, (torch.randn(BATCH, 6),), {"scale": torch.rand(BATCH, 1) + 0.5}
