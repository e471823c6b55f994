"""Quickstart: compile a small GPT onto 4 CPU devices, print the stage table, train a few steps.

    python examples/quickstart.py
"""

import torch

import pipecompile as pc
from pipecompile import zoo


def main() -> None:
    torch.manual_seed(0)
    vocab, seq, batch = 128, 32, 16
    model = zoo.GPT(vocab=vocab, dim=64, layers=6, heads=4, seq=seq)

    # A toy language: each token is the previous one plus one (mod vocab), from a random start.
    def batch_of_sequences():
        start = torch.randint(0, vocab, (batch, 1))
        tokens = (start + torch.arange(seq + 1)) % vocab
        return tokens[:, :-1], tokens[:, 1:]

    x, y = batch_of_sequences()
    pipe = pc.compile(
        model,
        example_inputs=(x,),
        devices=4,
        microbatches=4,
        schedule="gpipe",
        loss_fn=zoo.lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
    print(pipe)
    print()
    print(pipe.explain())
    print()
    for step in range(30):
        x, y = batch_of_sequences()
        loss = pipe.step(x, target=y)
        if step % 5 == 0 or step == 29:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
