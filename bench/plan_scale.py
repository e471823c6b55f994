"""Plan scale: a Llama-3-70B-shaped model planned for H100s it never runs on, by depth.

The model is `examples/factories.py:llama3_70b` (transformers LlamaForCausalLM on the meta
device: hidden 8192, MLP 28672, 64 heads / 8 KV heads, vocab 128256, bfloat16, its own loss from
labels) with 8, 16, 32, 48 and 80 layers, batch 32 x 4096 tokens, planned for min(32, layers)
`pipecompile.preset("h100")` devices with AdamW state counted, everything else "auto". Each size
runs in a fresh subprocess, so its peak RSS (`ru_maxrss`) is its own; "compile" is the
`pipecompile.compile` call, "process" adds importing torch/transformers and building the model.

Then one stage's predicted memory is set against Megatron-LM's theoretical formula
(`megatron/training/theoretical_memory_usage.py`; Korthikanti et al. 2022, Table 2) for the same
configuration: the first stage that holds only transformer layers (k of them, n micro-batches
in flight under the chosen schedule, micro-batch b, sequence s, hidden h, a heads):

    weights + grads + Adam   k * P_layer * bytes/param: Megatron 18 (bf16 weights and fp32
                             grads, master weights, Adam m and v; no distributed optimizer);
                             pipecompile counts what the model holds: bf16 weights, bf16 grads
                             and AdamW's two bf16 states = 8
    activations              n * k * s*b*h * (34 + 5*a*s/h) bytes: no recomputation and no flash
                             attention (the s^2 softmax terms kept), which is what a capture of
                             scaled_dot_product_attention on this CPU saves; Megatron's code
                             (selective recomputation) uses s*b*h*(18 + 4*ffn/h), printed too
    P_layer                  Megatron's count: 2h(1.5*ffn + 1) + 2h^2(1 + groups/a) (SwiGLU,
                             RMSNorm, grouped-query attention)

pipecompile's side is the same stage's memory *without* recomputation (params + grads + optimizer
state + n * (saved activations + received input), `partition.stage_memory` with recompute off),
and the chosen plan's memory (which may recompute). Results are appended by hand to
bench/RESULTS.md.

    python bench/plan_scale.py                      # 8, 16, 32, 48, 80 layers
    python bench/plan_scale.py --layers 8 80
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

import _common as C

SEQ, BATCH, HIDDEN, FFN, HEADS, KV_HEADS = 4096, 32, 8192, 28672, 64, 8
P_LAYER = 2 * HIDDEN * (1.5 * FFN + 1) + 2 * HIDDEN**2 * (1 + KV_HEADS / HEADS)
GiB = 2**30


def one(layers: int, devices: int) -> dict:
    """Compile one size in this process; what the parent prints (JSON on stdout)."""
    start = time.perf_counter()
    import torch

    sys.path.insert(0, os.path.join(C.ROOT, "examples"))
    import factories

    import pipecompile as pc
    from pipecompile.passes.partition import PartitionProblem, stage_memory

    model, args, kwargs = factories.llama3_70b(layers=layers, batch=BATCH, seq=SEQ)
    t0 = time.perf_counter()
    pipe = pc.compile(model, args, kwargs, devices=[pc.preset("h100")] * devices,
                      optimizer=lambda p: torch.optim.AdamW(p))
    compile_s = time.perf_counter() - t0
    plan = pipe.plan
    costs, placement, blocks = plan.costs, plan.placement, plan.linear.blocks
    plain = PartitionProblem(  # the same stages without recomputation
        block_times=tuple(b.time for b in costs.blocks), cut_bytes=costs.cut_bytes,
        static_bytes=tuple(b.static_bytes for b in costs.blocks),
        activation_bytes=tuple(b.activation_bytes for b in costs.blocks),
        devices=plan.stage_specs, inflight=plan.inflight)
    layer_of = [_layer(b.name) for b in blocks]  # None: not in a transformer layer
    stages = []
    for j, (a, b) in enumerate(zip(placement.bounds, placement.bounds[1:])):
        held = set(layer_of[a:b])
        whole = None not in held and all(  # every block of each of its layers is here
            layer_of.index(i) >= a and len(layer_of) - layer_of[::-1].index(i) <= b
            for i in held)
        stages.append(dict(
            layers=len(held - {None}), only_layers=whole, granularity=plan.linear.granularity,
            params=sum(c.param_count for c in costs.blocks[a:b]),
            static=sum(c.static_bytes for c in costs.blocks[a:b]),
            activations=sum(c.activation_bytes for c in costs.blocks[a:b]),
            received=costs.cut_bytes[a], inflight=plan.inflight[j],
            plain=stage_memory(plain, j, a, b), chosen=placement.stage_memory[j],
            recompute=bool(placement.recompute and placement.recompute[j])))
    o = plan.resolved
    return dict(layers=layers, devices=devices, compile_s=compile_s,
                process_s=time.perf_counter() - start,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                schedule=o.schedule, microbatches=o.microbatches, virtual=o.virtual_stages,
                microbatch_size=BATCH // o.microbatches, step_s=plan.predicted.makespan,
                passes={r.name: r.seconds for r in plan.passes}, stages=stages)


def _layer(block: str) -> int | None:
    """The transformer layer a block belongs to ("model.layers.7", "model.layers.7#2" -> 7),
    else None."""
    found = re.match(r"model\.layers\.(\d+)", block)
    return int(found.group(1)) if found else None


def megatron(stage: dict, b: int) -> dict:
    """Megatron-LM's theoretical bytes of a stage of k transformer layers, n in flight."""
    k, n, sbh = stage["layers"], stage["inflight"], SEQ * b * HIDDEN
    return dict(weights18=k * P_LAYER * 18, weights8=k * P_LAYER * 8,
                activations=n * k * sbh * (34 + 5 * HEADS * SEQ / HIDDEN),
                selective=n * k * sbh * (18 + 4 * FFN / HIDDEN))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 48, 80])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.one:
        print(json.dumps(one(opts.one, opts.devices)))
        return
    print(f"# plan scale: Llama-3-70B-shaped, batch {BATCH} x {SEQ}, H100 presets, AdamW; "
          f"{C.machine()}, load {C.loadavg()}")
    results = []
    for layers in opts.layers:
        devices = min(32, layers)
        done = subprocess.run([sys.executable, __file__, "--one", str(layers), "--devices",
                               str(devices)], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{layers} layers failed:\n{done.stderr[-3000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    header = ("layers", "devices", "compile s", "process s", "peak RSS", "capture s", "search s",
              "plan", "predicted step s")
    rows = []
    for r in results:
        rows.append((str(r["layers"]), str(r["devices"]), f"{r['compile_s']:.1f}",
                     f"{r['process_s']:.1f}", f"{r['rss'] / GiB:.2f} GiB",
                     f"{r['passes'].get('capture', 0):.1f}", f"{r['passes'].get('search', 0):.1f}",
                     f"{r['schedule']} m={r['microbatches']} v={r['virtual']}",
                     f"{r['step_s']:.2f}"))
    print(C.table(rows, header))
    print("\n# one stage of transformer layers against Megatron-LM's theoretical memory "
          "(GiB; micro-batch b, n in flight)")
    header = ("layers", "stage", "k", "b", "n", "ours: static", "Megatron 18 B/p", "(8 B/p)",
              "ours: act.", "Korthikanti", "ratio", "(selective)", "ours total",
              "Megatron total", "ratio", "chosen")
    rows = []
    for r in results:
        j, stage = next(((j, s) for j, s in enumerate(r["stages"]) if j and s["only_layers"]),
                        (None, None))
        if stage is None:  # sub-layer blocks: no stage holds whole layers only
            rows.append((str(r["layers"]), "-", *["-"] * 13, "no stage of whole layers"))
            continue
        ref = megatron(stage, r["microbatch_size"])
        acts = stage["plain"] - stage["static"]
        ours, theirs = stage["plain"], ref["weights18"] + ref["activations"]
        rows.append((str(r["layers"]), str(j), str(stage["layers"]), str(r["microbatch_size"]),
                     str(stage["inflight"]), f"{stage['static'] / GiB:.1f}",
                     f"{ref['weights18'] / GiB:.1f}", f"{ref['weights8'] / GiB:.1f}",
                     f"{acts / GiB:.1f}", f"{ref['activations'] / GiB:.1f}",
                     f"{acts / ref['activations']:.3f}", f"{ref['selective'] / GiB:.1f}",
                     f"{ours / GiB:.1f}", f"{theirs / GiB:.1f}", f"{ours / theirs:.3f}",
                     f"{stage['chosen'] / GiB:.1f}" + (" (recompute)" if stage["recompute"]
                                                       else "")))
    print(C.table(rows, header))
    print(f"P_layer = {P_LAYER:,.0f} parameters (Megatron's formula); ours per layer: "
          + ", ".join(f"{s['params'] / max(1, s['layers']):,.0f}" for s in
                      [next(s for j, s in enumerate(results[-1]["stages"]) if j
                            and s["only_layers"])] if results))


if __name__ == "__main__":
    main()
