"""Where a tensor-parallel row of `bench/_published_tp.py` spends its predicted step.

    python bench/tp_breakdown.py 39.1B           # one row (a part of its name)
    python bench/tp_breakdown.py Llama --no-sp

Plans the row as `bench/_published_tp.py` does, then prints the step's breakdown on its busiest
device (planner/breakdown.py) and, for the costliest transformer layer, one rank's share of
its kernels by kind (forward, backward; whole and 1/T), the tensor-parallel all-reduce (its
bytes, its price, how many per layer) and the memory-bound kernels that stay replicated. The
breakdown's kernel parts are split in the proportions of the whole (unsharded) layer, so the
tensor-parallel collectives and the shard's own proportions are printed from the layer here.
"""

from __future__ import annotations

import sys

import _common as C  # noqa: F401  (puts the repository root on sys.path)
import _published_tp as T

from pipecompile.ir.records import evaluate
from pipecompile.passes.annotate import PricedBlockCost
from pipecompile.planner import decisions, layout_passes, tensor_costs
from pipecompile.planner.breakdown import step_breakdown

_SEEN: list = []


def _recording(real):
    def shard_costs(costs, share, **kw):
        out = real(costs, share, **kw)
        _SEEN.append((costs, share, kw, out))
        return out
    return shard_costs


def _layer(costs, share, kw, out) -> None:
    rates, t = kw["rates"], share.degree
    value = lambda e: evaluate(e, costs.sizes)  # noqa: E731
    priced = [(i, c) for i, c in enumerate(costs.symbolic) if isinstance(c, PricedBlockCost)]
    print("blocks (ms one rank, at the plan's micro-batch): forward whole -> sharded "
          "(collective in it), cut bytes after (MB)")
    for i, c in priced[:6]:
        x, y = costs.blocks[i], out.blocks[i]
        kf = tensor_costs._shard_kernels(c.kernels, t, value, x.backward_flops,
                                         share.sequence_parallel)
        f1 = kf.kernels.times(kf.backward_flops, rates, value)[0]
        print(f"  block {i}: {x.forward_time * 1e3:.3f} -> {y.forward_time * 1e3:.3f} "
              f"({(y.forward_time - f1) * 1e3:.3f}), cut {costs.cut_bytes[i + 1] / 1e6:.1f}, "
              f"gemms {[(value(g[1]), value(g[2])) for g in c.kernels.gemms]}")
    i, c = max(priced, key=lambda ic: costs.blocks[ic[0]].forward_time)
    x = costs.blocks[i]
    found = tensor_costs._shard_kernels(c.kernels, t, value, x.backward_flops,
                                        share.sequence_parallel)
    f0, b0 = c.kernels.parts(x.backward_flops, rates, value)
    f1, b1 = found.kernels.parts(found.backward_flops, rates, value)
    print(f"\nlayer (block {i}) at micro-batch {kw['batch_size']}, T={t}"
          f"{' +SP' if share.sequence_parallel else ''}: ms by kind")
    print(f"  {'':<22}{'matmul':>9}{'attention':>10}{'memory':>9}{'loss':>8}{'launch':>8}"
          f"{'total':>9}")
    for name, k in (("forward whole", f0), ("backward whole", b0),
                    ("forward 1/T rank", f1), ("backward 1/T rank", b1)):
        print(f"  {name:<22}{k.matmul * 1e3:9.3f}{k.attention * 1e3:10.3f}"
              f"{k.memory * 1e3:9.3f}{k.loss * 1e3:8.3f}{k.launch * 1e3:8.3f}"
              f"{k.total * 1e3:9.3f}")
    nbytes = found.tokens * found.narrowest * found.itemsize
    one = share.all_reduce(nbytes)
    print(f"  all-reduce of {nbytes / 1e6:.1f} MB over {t} on {share.link.name} "
          f"({share.link.bandwidth / 1e9:.0f} GB/s, {share.link.step_latency * 1e6:.1f} us/step): "
          f"{one * 1e3:.3f} ms; priced layer forward {x.forward_time * 1e3:.3f} -> sharded "
          f"{out.blocks[i].forward_time * 1e3:.3f} ms")
    sharded = out.blocks[i]
    print(f"  sharded block times (ms): forward {sharded.forward_time * 1e3:.3f}, backward "
          f"input {sharded.backward_input_time * 1e3:.3f}, weight "
          f"{sharded.backward_weight_time * 1e3:.3f}; collectives in them "
          f"{(sharded.forward_time - f1.total) * 1e3:.3f} fwd")
    print("  GEMMs one rank runs (m, n, k, batch, count):")
    for m, n, kk, b, size, count in found.kernels.gemms:
        print(f"    {value(m):.0f} x {value(n):.0f} x {value(kk):.0f} x {value(b):.0f}  x{count}")
    print("  memory-bound kernels (MB whole, count, 1/T or whole on a rank), forward:")
    mine = {value(b): cnt for b, cnt in found.kernels.moves}
    for b, cnt in c.kernels.moves:
        v = value(b)
        print(f"    {v / 1e6:10.2f} MB x{cnt}  {'1/T' if v / t in mine else 'whole'}")


def main() -> None:
    only = next((a for a in sys.argv[1:] if not a.startswith("--")), "")
    decisions.shard_costs = _recording(decisions.shard_costs)
    layout_passes.shard_costs = _recording(layout_passes.shard_costs)
    for row in T.rows(only):
        print(" | ".join(row))
    pipe = T.LAST
    print(step_breakdown(pipe.plan))
    final = pipe.plan.ready.costs.blocks
    costs, share, kw, out = next((e for e in reversed(_SEEN) if e[3].blocks == final),
                                 _SEEN[-1])
    _layer(costs, share, kw, out)
    _collectives(pipe, costs, share, kw, out)


def _collectives(pipe, costs, share, kw, out) -> None:
    """Seconds of tensor-parallel collectives on the breakdown's device per step: each block's
    priced time less its kernels, in forward, input gradient and a recomputed forward."""
    plan, rates, t = pipe.plan, kw["rates"], share.degree
    value = lambda e: evaluate(e, costs.sizes)  # noqa: E731
    parts = step_breakdown(plan)
    o, bounds = plan.resolved, plan.ready.placement.bounds
    total = 0.0
    for s, d in enumerate(plan.schedule.stage_to_device):
        if d != parts.device:
            continue
        for i in range(bounds[s], bounds[s + 1]):
            c = costs.symbolic[i]
            if not isinstance(c, PricedBlockCost):
                continue
            k = tensor_costs._shard_kernels(c.kernels, t, value, costs.blocks[i].backward_flops,
                                            share.sequence_parallel)
            each = out.blocks[i].forward_time - k.kernels.times(k.backward_flops, rates,
                                                                value)[0]
            total += each * (3 if o.stage_checkpoint(s) else 2) * o.microbatches
    print(f"\ntensor-parallel collectives on device {parts.device}: {total * 1e3:.1f} ms of the "
          f"{parts.step * 1e3:.1f} ms step ({total / parts.step:.1%}; inside the kernel parts "
          f"above, which split compute in the whole layer's proportions)")


if __name__ == "__main__":
    main()
