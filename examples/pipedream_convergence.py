"""Convergence of 1F1B (synchronous), PipeDream (weight stashing) and 2BW at equal samples.

A small GPT (untied embeddings: asynchronous stages cannot share a parameter) learns a toy
language (each token is the previous plus one, from a random start) on 4 pipeline stages with
AdamW. All three see the same batches; the plot shows the loss per batch, the table the final
loss (mean of the last 10 batches).

    python examples/pipedream_convergence.py --out pipedream_convergence.png
"""

import argparse
import copy

import torch

import pipecompile as pc
from pipecompile import zoo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="pipedream_convergence.png")
    opts = parser.parse_args()
    torch.manual_seed(0)
    vocab, seq, batch = 64, 16, 16
    base = zoo.GPT(vocab=vocab, dim=32, layers=4, heads=2, seq=seq, tied=False)
    data = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(opts.steps):
        start = torch.randint(0, vocab, (batch, 1), generator=data)
        tokens = (start + torch.arange(seq + 1)) % vocab
        batches.append(((tokens[:, :-1],), tokens[:, 1:]))

    curves = {}
    for schedule in ("1f1b", "pipedream", "2bw"):
        # PipeDream updates once per micro-batch: a 4x smaller learning rate keeps the
        # per-sample step size comparable with the once-per-batch schedules.
        lr = 1e-3 if schedule == "pipedream" else 4e-3
        pipe = pc.compile(copy.deepcopy(base), batches[0][0], devices=4, microbatches=4,
                          schedule=schedule, loss_fn=zoo.lm_loss,
                          optimizer=lambda p, lr=lr: torch.optim.AdamW(p, lr=lr))
        losses = [float(l) for l in pipe.fit(batches)]
        curves[schedule] = losses
        print(f"{schedule:<10} first {losses[0]:.3f}  final (last 10) "
              f"{sum(losses[-10:]) / 10:.3f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot([(i + 1) * batch for i in range(len(losses))], losses, label=name)
    ax.set_xlabel("samples")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title("4 stages, 4 micro-batches, AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(opts.out)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
