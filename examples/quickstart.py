"""Quickstart: the declarative call on a small GPT over 4 CPU devices; the first step plans.

    python examples/quickstart.py

Nothing is hand-picked: `compile(model, devices=4, loss_fn=...)` captures and plans on the first
`pipe.step` (schedule, micro-batches, virtual stages and recomputation chosen by predicted step
time), then trains with your own optimizer over `pipe.parameters()`.
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

    pipe = pc.compile(model, devices=4, loss_fn=zoo.lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)  # the model's own tensors and names
    for step in range(30):
        x, y = batch_of_sequences()
        loss = pipe.step(x, target=y)  # the first call captures and plans
        opt.step()
        opt.zero_grad()
        if step == 0:
            print(pipe)
            print()
            print(pipe.explain())
            print()
        if step % 5 == 0 or step == 29:
            print(f"step {step:3d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
