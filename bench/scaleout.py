"""Pipeline x data parallel on 4 gloo ranks (2 stages x 2 replicas): FSDP2 sharding
(`fsdp=True`) against replicated stages, in one run.

Per rank: the bytes it holds of parameters, gradients and AdamW state (a DTensor counts its
local shard), and the median step time (step + clip + optimizer step) over the timed steps.
Both modes run the same model, batch and schedule in the same job, alternating, so that the
machine's noise falls on both.

    torchrun --nproc-per-node 4 bench/scaleout.py            # GPT d=256, 8 layers
    torchrun --nproc-per-node 4 bench/scaleout.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402
from pipecompile.ir.tensors import local_tensor  # noqa: E402

FULL = dict(vocab=4096, dim=256, layers=8, heads=8, seq=64)
QUICK = dict(vocab=512, dim=64, layers=4, heads=4, seq=32)


def nbytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def run(fsdp: bool, sizes: dict, steps: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    replica = dist.get_rank() // 2
    torch.manual_seed(0)
    model = zoo.GPT(**sizes)
    xs, ys = x.chunk(2)[replica], y.chunk(2)[replica]
    pipe = pc.compile(model, example_inputs=(xs,), devices=2, data_parallel=2, fsdp=fsdp,
                      loss_fn=zoo.lm_loss, schedule="1f1b", microbatches=4, timeout=600)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 1):  # the first step warms up (FSDP's lazy init, allocations)
        dist.barrier()
        start = time.perf_counter()
        loss = pipe.step(xs, target=ys)
        pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        if step:
            times.append(time.perf_counter() - start)
    params = list(pipe.parameters())
    state = [t for s in opt.state.values() for t in s.values()
             if isinstance(t, torch.Tensor) and t.dim() > 0]
    return {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
            "optim": nbytes(state), "step": statistics.median(times), "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    assert dist.get_world_size() == 4, "launch with torchrun --nproc-per-node 4"
    sizes = QUICK if args.quick else FULL
    steps = args.steps or (3 if args.quick else 6)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, sizes["vocab"], (16, sizes["seq"]), generator=g)
    y = torch.randint(0, sizes["vocab"], (16, sizes["seq"]), generator=g)
    rows = {}
    for fsdp in (True, False, True, False):  # alternating: each mode's best of two runs
        result = run(fsdp, sizes, steps, x, y)
        every = [None] * 4
        dist.all_gather_object(every, result)
        name = "fsdp=True" if fsdp else "replicated"
        if name not in rows or max(r["step"] for r in every) < max(r["step"] for r in rows[name]):
            rows[name] = every
    if dist.get_rank() == 0:
        mib = 2**20
        print(f"GPT {sizes}, batch 16 (8 per replica), 1f1b m=4, AdamW; 4 gloo ranks = 2 stages "
              f"x 2 replicas; torch {torch.__version__}")
        print("mode        rank  params MiB  grads MiB  AdamW MiB  total MiB  step ms")
        for name, every in rows.items():
            for rank, r in enumerate(every):
                total = r["params"] + r["grads"] + r["optim"]
                print(f"{name:<10}  {rank:>4}  {r['params'] / mib:>10.2f}  {r['grads'] / mib:>9.2f}"
                      f"  {r['optim'] / mib:>9.2f}  {total / mib:>9.2f}  {r['step'] * 1e3:>7.1f}")
        sharded, replicated = rows["fsdp=True"], rows["replicated"]
        held = [sum(r[k] for k in ("params", "grads", "optim")) for r in sharded]
        full = [sum(r[k] for k in ("params", "grads", "optim")) for r in replicated]
        step_s = max(r["step"] for r in sharded)
        step_r = max(r["step"] for r in replicated)
        print(f"memory per rank, fsdp / replicated: "
              f"{', '.join(f'{a / b:.2f}' for a, b in zip(held, full))}")
        print(f"step (slowest rank), fsdp / replicated: {step_s * 1e3:.1f} / {step_r * 1e3:.1f} ms"
              f" = {step_s / step_r:.2f}x; losses {sharded[1]['loss']:.6f} / "
              f"{replicated[1]['loss']:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
