"""passes/annotate: costing is a pure function of the graph and the device.

A model built on the meta device is costed like the same model built for real (its tensors
claim the device they will run on), nothing one compile leaves in the process changes how a
later one is costed, and a block that cannot be costed on fake tensors is a warning, never a
silent zero.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import pipecompile.passes.annotate as annotate_module
from pipecompile.capture.capture import capture
from pipecompile.ir.compile_cache import CompileCache
from pipecompile.passes.annotate import symbolic_block_costs
from pipecompile.passes.linearize import linearize

# Four blocks of Linear(32, 64) -> ReLU -> Linear(64, 32); batch 8 in 2 micro-batches of 4:
# 2 * 4 * (32 * 64 + 64 * 32) = 32,768 forward FLOPs per block, two blocks per stage.
_SCRIPT = """
import json, warnings
import torch, torch.nn as nn
import pipecompile as pc

def make():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                           for _ in range(4)])

x = torch.randn(8, 32)
flops = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for kind in ORDER:
        if kind == "meta":
            with torch.device("meta"):
                model = make()
        else:
            model = make()
        pipe = pc.compile(model, devices=2, example_inputs=(x,), microbatches=2,
                          schedule="gpipe")
        flops[kind] = [s.cost.forward_flops for s in pipe.stages]
warned = [str(w.message) for w in caught if "could not be costed" in str(w.message)]
print(json.dumps({"flops": flops, "warned": warned}))
"""


def test_a_meta_model_then_a_real_one_cost_the_same_in_a_fresh_process():
    script = _SCRIPT.replace("ORDER", repr(["meta", "real"]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["warned"] == []
    assert result["flops"]["meta"] == result["flops"]["real"] == [65536.0, 65536.0]


def _chain():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def test_a_block_that_cannot_be_costed_warns_on_every_compile_cached_or_not(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("no fake kernel for this op")

    monkeypatch.setattr(annotate_module, "_run_block_fake", fails)
    linear = linearize(capture(_chain(), (torch.randn(4, 16),), {}))
    cache = CompileCache()
    for _ in range(2):  # computed, then from the cache: both warn
        with pytest.warns(RuntimeWarning, match=r"could not be costed .*no fake kernel"):
            costs = symbolic_block_costs(linear, cache=cache)
        assert all(c.forward_flops == 0 for c in costs)
    assert cache.hits == 1 and cache.misses == 1


def test_the_cost_key_tells_a_meta_model_from_a_real_one():
    """Costs kept in a cache are found again only for tensors on the same devices."""
    x = torch.randn(4, 16)
    torch.manual_seed(0)
    real = linearize(capture(_chain(), (x,), {}))
    with torch.device("meta"):
        meta_model = _chain()
    meta = linearize(capture(meta_model, (x.to("meta"),), {}))
    assert (annotate_module._cost_key(real, 0.0) != annotate_module._cost_key(meta, 0.0))
