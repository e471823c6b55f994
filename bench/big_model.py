"""Memory per rank for a model bigger than one process needs: built on meta, loaded per rank.

Writes a GPT of about 1.2 GiB (float32) as transformers-style safetensors shards with
model.safetensors.index.json, then launches `torchrun --nproc-per-node 4` twice:

    meta   build on meta -> compile(devices=4) -> to_empty -> load_weights(shards) -> one step
    eager  build with real weights on every rank -> compile(devices=4) -> one step (how every
           rank had to do it before meta models compiled)

Each rank reports its peak RSS growth over the RSS it had before building the model (after
importing torch and joining the process group), and the ratio to the model's bytes. A rank's
share is a quarter of the weights and their gradients (0.5x) plus what reading costs; the batch
is small (4 x 32 tokens) so that activations add little.

    python bench/big_model.py              # 24 layers, d=1024: 1.16 GiB of float32 weights
    python bench/big_model.py --quick      # 6 layers, d=512, for a fast check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from pipecompile import zoo  # noqa: E402

FULL = dict(vocab=8192, dim=1024, layers=24, heads=16, seq=64)
QUICK = dict(vocab=4096, dim=512, layers=6, heads=8, seq=64)
SHARD_BYTES = 256 << 20


def rss_mib() -> float:
    """The current resident set size (MiB) from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def write_shards(sizes: dict, directory: str) -> int:
    """The model's weights as shards + index (the tied lm_head stored once); its bytes."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {k: v for k, v in zoo.GPT(**sizes).state_dict().items() if k != "lm_head.weight"}
    shards: list[dict] = [{}]
    size = 0
    for key, tensor in state.items():
        if size > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, name))
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def rank_main(mode: str, sizes: dict, directory: str, model_bytes: int) -> None:
    import torch.distributed as dist

    import pipecompile as pc

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # a small batch (4 micro-batches of one 32-token sequence): what is measured is the
    # weights' memory, not the activations a larger batch would add on every rank alike
    x = torch.randint(0, sizes["vocab"], (4, 32), generator=torch.Generator().manual_seed(1))
    base = rss_mib()
    if mode == "meta":
        with torch.device("meta"):
            model = zoo.GPT(**sizes)
    else:
        torch.manual_seed(0)
        model = zoo.GPT(**sizes)
    pipe = pc.compile(model, example_inputs=(x,), devices=dist.get_world_size(),
                      loss_fn=zoo.lm_loss, schedule="1f1b", microbatches=4, timeout=600)
    compiled, compile_peak = rss_mib() - base, peak_mib() - base
    if mode == "meta":
        pipe.to_empty()
        result = pipe.load_weights(directory)
        assert not result.missing_keys, result.missing_keys
    loaded, load_peak = rss_mib() - base, peak_mib() - base
    loss = pipe.step(x, target=x)
    own = sum(p.numel() * p.element_size() for p in pipe.parameters())
    peak = peak_mib() - base
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (rank, own / 2**20, compiled, compile_peak, loaded, load_peak,
                                  peak))
    if rank == 0:
        mib = model_bytes / 2**20
        print(f"\n{mode}: model {mib:.0f} MiB ({mib / 1024:.2f} GiB), loss {loss.item():.6f}")
        print("MiB over the rank's RSS before building the model (peak: the most so far)")
        print("rank  own params  compiled (peak)  loaded (peak)  step peak  peak / model")
        for r, o, c, cp, lo, lp, p in rows:
            print(f"{r:<4}  {o:>10.0f}  {c:>8.0f} ({cp:>4.0f})  {lo:>6.0f} ({lp:>4.0f})  "
                  f"{p:>9.0f}  {p / mib:>10.2f}x")
        print(f"worst rank: {max(row[-1] for row in rows) / mib:.2f}x the model's bytes")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rank-mode", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    if args.rank_mode:
        rank_main(args.rank_mode, sizes, args.dir, args.bytes)
        return
    with tempfile.TemporaryDirectory() as directory:
        total = write_shards(sizes, directory)
        print(f"GPT {sizes}: {total / 2**30:.2f} GiB of float32 weights in "
              f"{len(os.listdir(directory)) - 1} shards; {args.ranks} gloo ranks")
        for mode in ("meta", "eager"):
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                            str(args.ranks), os.path.abspath(__file__), "--rank-mode", mode,
                            "--dir", directory, "--bytes", str(total)]
                           + (["--quick"] if args.quick else []), check=True)


if __name__ == "__main__":
    main()
