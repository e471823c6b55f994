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
import warnings

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecompile.passes.annotate as annotate_module
from pipecompile.capture.capture import capture
from pipecompile.ir.compile_cache import CompileCache
from pipecompile.passes.annotate import annotate, symbolic_block_costs
from pipecompile.passes.fake_values import FakeValues, fake_mode_of
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


class Windows(nn.Module):
    """Swin's window attention, reduced to its shapes: pad the image to whole windows of 4x4,
    partition it into windows, a Linear per token, merge the windows, crop. With the image's
    height and width symbolic the pad's amounts are symbolic, and its backward kernel takes
    only concrete sizes."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):  # (B, C, H, W)
        x = x.permute(0, 2, 3, 1)
        b, h, w, c = x.shape
        x = F.pad(x, (0, 0, 0, (4 - w % 4) % 4, 0, (4 - h % 4) % 4))
        hp, wp = x.shape[1], x.shape[2]
        x = x.view(b, hp // 4, 4, wp // 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 16, c)
        x = self.mix(x)
        x = x.view(b, hp // 4, wp // 4, 4, 4, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
        return self.out(x[:, :h, :w, :]).permute(0, 3, 1, 2)


@pytest.fixture(scope="module")
def windows():
    """A 1x1 convolution, then the windows (so the windows' input needs a gradient and their
    pad runs backward), captured with every size symbolic and with the batch alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 1), Windows())
    x = torch.randn(2, 8, 6, 6)  # 6 is not a whole number of windows: padded to 8
    # a generous budget: on a loaded machine the export must not fall back to the batch alone
    return {sizes: capture(model, (x,), {}, sizes=sizes, budget=900.0)
            for sizes in ("all", "batch")}


def test_costs_with_every_size_symbolic_equal_the_batch_only_costs_at_the_example(windows):
    """The pad's backward fails on fake tensors with symbolic sizes (every size, or the batch
    alone): the block is costed again with fewer symbols, down to two concrete batch sizes,
    and both captures give the FLOPs counted by hand."""
    cache = CompileCache()  # empty: both computed here; the micro-batch of 1 below reuses "all"
    every, batch = (annotate(linearize(windows[s]), microbatch_size=2, cache=cache)
                    for s in ("all", "batch"))
    assert len(every.symbolic[0].forward_flops.free_symbols) == 3  # batch, height, width
    # the convolution: 2 * 8 * 8 FLOPs per pixel of 2 x 6 x 6; the windows: a Linear(8, 8) per
    # token on 2 x 8 x 8 padded tokens, then another on the 2 x 6 x 6 cropped ones
    conv, padded, cropped = 2 * 8 * 8 * 2 * 6 * 6, 2 * 8 * 8 * 2 * 8 * 8, 2 * 8 * 8 * 2 * 6 * 6
    assert [b.forward_flops for b in batch.blocks] == [conv, padded + cropped]
    assert [b.forward_flops for b in every.blocks] == [b.forward_flops for b in batch.blocks]
    assert [b.backward_flops for b in every.blocks] == [b.backward_flops for b in batch.blocks]
    # linear in the batch: the same at a micro-batch of 1
    assert [b.forward_flops for b in annotate(linearize(windows["all"]), microbatch_size=1,
                                              cache=cache).blocks] == [
        conv / 2, (padded + cropped) / 2]
    assert cache.misses == 2 and cache.hits == 1  # the same symbolic costs, not recomputed


def test_specialized_fake_values_keep_the_batch_symbolic(windows):
    captured = windows["all"]
    graph = captured.module.graph
    placeholder = next(iter(graph.find_nodes(op="placeholder")))
    others = {s: v for s, v in captured.example_sizes.items() if s != captured.batch_symbol}
    fakes = FakeValues(fake_mode_of(graph), None).specialized(others, captured.example_sizes)
    value = fakes.graph_value(placeholder.meta["val"])
    assert isinstance(value.shape[0], torch.SymInt)
    assert value.shape[0].node.expr == captured.batch_symbol
    assert tuple(value.shape[1:]) == (8, 6, 6)


def test_an_fx_capture_is_costed_like_an_export_capture():
    """fx capture calls the layers as modules: FlopCounterMode's module hooks must not be given
    a leaf tensor while the backward runs (every block after the first failed so, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 8))
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        costs = {method: annotate(linearize(capture(model, (x,), {}, method=method)),
                                  microbatch_size=4).blocks
                 for method in ("fx", "export")}
    flops = {m: [(b.forward_flops, b.backward_flops) for b in c] for m, c in costs.items()}
    assert flops["fx"] == flops["export"]
    assert [f for f, _ in flops["fx"]] == [2 * 4 * 16 * 32, 0, 2 * 4 * 32 * 16, 2 * 4 * 16 * 8]


class _Attention(nn.Module):
    """A block with each kind of kernel the presets price: GEMMs, softmax attention, a GELU,
    a LayerNorm and a loss over a vocabulary."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 40)

    def forward(self, x):  # (B, S, 16)
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(x.shape))
        return torch.log_softmax(self.head(F.gelu(self.norm(x))), -1)


def _at(value, batch, b):
    """`value` (costs: dataclasses, tuples, sympy) with the batch at `b`, as plain numbers."""
    import dataclasses

    import sympy

    if dataclasses.is_dataclass(value):
        return tuple(_at(getattr(value, f.name), batch, b) for f in dataclasses.fields(value))
    if isinstance(value, tuple):
        return tuple(_at(v, batch, b) for v in value)
    if isinstance(value, sympy.Basic):
        return float(value.xreplace({batch: b}))
    return value


@pytest.mark.parametrize("fused", [False, True])
def test_costs_fitted_through_two_concrete_batches_equal_the_symbolic_ones(monkeypatch, fused):
    """A block whose fake run fails with a symbolic batch is costed at two concrete batch sizes
    and fitted linearly: its kernels (the GEMM shapes and bytes a chip prices, fused=True)
    too, not only its FLOPs and saved bytes; they had stayed at the example's batch."""
    torch.manual_seed(0)
    linear = linearize(capture(_Attention(), (torch.randn(4, 8, 16),), {}))
    batch = linear.captured.batch_symbol
    symbolic = symbolic_block_costs(linear, fused=fused)
    real = annotate_module._run_block_fake

    def only_concrete(block_nodes, nodes, roles, gm, fakes, *args):
        if batch not in fakes.specialize:
            raise RuntimeError("this kernel takes only concrete sizes")
        return real(block_nodes, nodes, roles, gm, fakes, *args)

    monkeypatch.setattr(annotate_module, "_run_block_fake", only_concrete)
    fitted = symbolic_block_costs(linear, fused=fused)
    assert any(c.activation_bytes != 0 for c in symbolic)
    for b in (1, 3, 4):
        assert _at(fitted, batch, b) == _at(symbolic, batch, b)


def test_a_size_check_while_costing_leaves_the_batch_symbolic(monkeypatch):
    """A kernel that reads a size as an int while the block is costed (a backend chosen by
    comparing sizes) guards on the example's batch; the guard must not replace the batch
    symbol, or every later block is costed at the example's batch. The costs equal those of a
    run without the check, at every batch."""
    torch.manual_seed(0)
    linear = linearize(capture(_Attention(), (torch.randn(4, 8, 16),), {}))
    batch = linear.captured.batch_symbol
    unchecked = symbolic_block_costs(linear, fused=True)
    real = annotate_module._run_block_fake
    placeholder = next(iter(linear.captured.module.graph.find_nodes(op="placeholder")))

    def size_checked(*args, **kwargs):
        assert int(placeholder.meta["val"].shape[0]) == 4  # a guard: s0 == 4
        return real(*args, **kwargs)

    monkeypatch.setattr(annotate_module, "_run_block_fake", size_checked)
    checked = symbolic_block_costs(linear, fused=True)
    assert any(batch in c.forward_flops.free_symbols for c in checked)
    for b in (1, 3, 4):
        assert _at(checked, batch, b) == _at(unchecked, batch, b)



def test_a_guard_recorded_on_another_thread_while_costing_is_a_warning(monkeypatch):
    """A guard recorded where the suppression does not reach (another thread, as autograd's
    device thread was on CUDA) fixes the batch for every later block: a warning names the
    block and the batch, instead of costs silently constant."""
    import threading

    torch.manual_seed(0)
    linear = linearize(capture(_Attention(), (torch.randn(4, 8, 16),), {}))
    real = annotate_module._run_block_fake
    placeholder = next(iter(linear.captured.module.graph.find_nodes(op="placeholder")))

    def guarded_elsewhere(*args, **kwargs):
        other = threading.Thread(target=lambda: int(placeholder.meta["val"].shape[0]))
        other.start()
        other.join()
        return real(*args, **kwargs)

    monkeypatch.setattr(annotate_module, "_run_block_fake", guarded_elsewhere)
    with pytest.warns(RuntimeWarning, match=r"costing block \S+ .*fixed the batch size at 4"):
        costs = symbolic_block_costs(linear)
    assert all(not sympy.sympify(c.forward_flops).free_symbols for c in costs)

# A model whose backward guards on the batch (col2im's, the backward of `nn.Unfold`), captured
# on CPU and as a meta model claiming an accelerator: a stand-in registered in the child process
# as the PrivateUse1 backend ("fakegpu"). A fake CUDA tensor cannot run autograd in a CPU-only
# torch (the engine aborts the process: no CUDA device guard), but the stand-in's backward runs
# as CUDA's does, on the autograd engine's device thread.
_ACCELERATOR_SCRIPT = """
import json, sympy, torch, torch.nn as nn
torch.utils.backend_registration._setup_privateuseone_for_python_backend(rename="fakegpu")
from pipecompile.capture.capture import capture
from pipecompile.capture.claimed_device import claiming, restore_tensors
from pipecompile.passes.annotate import symbolic_block_costs
from pipecompile.passes.linearize import linearize

def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(4, 4, 1), nn.Unfold(2), nn.Flatten(), nn.Linear(16 * 49, 8),
                         nn.ReLU(), nn.Linear(8, 8))

def costs(linear):
    batch = {linear.captured.batch_symbol: sympy.Symbol("B")}
    return [[str(sympy.sympify(e).xreplace(batch)) for e in (c.forward_flops,
             c.backward_input_flops, c.backward_weight_flops, c.activation_bytes)]
            for c in symbolic_block_costs(linear)]

x = torch.randn(6, 4, 8, 8)
with torch.device("meta"):
    model = make()
device = torch.device("fakegpu:0")
with claiming(model, ((x.to("meta"),), {}), device) as ((args, kwargs), originals):
    captured = restore_tensors(capture(model, args, kwargs), model, originals, device)
env = next(iter(captured.module.graph.find_nodes(op="placeholder"))).meta["val"].fake_mode
print(json.dumps({"device": str(next(iter(captured.module.graph.find_nodes(
                      op="placeholder"))).meta["val"].device),
                  "accelerator": costs(linearize(captured)),
                  "replacements": {str(k): str(v) for k, v in env.shape_env.replacements.items()},
                  "cpu": costs(linearize(capture(make(), (x,), {})))}))
"""


def test_a_backward_on_an_accelerator_thread_leaves_the_batch_symbolic():
    """On CUDA autograd runs a backward on its device thread, where the shape environment's
    guard suppression (thread-local) did not hold: col2im's guard replaced the batch by the
    example's, and every cost after it was a constant (on an H200, a Llama's costs at the full
    batch instead of the micro-batch). Costed with the backward kept on the caller's thread,
    the accelerator's costs are the CPU's, expressions of the batch."""
    done = subprocess.run([sys.executable, "-c", _ACCELERATOR_SCRIPT], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["device"] == "fakegpu:0"
    assert result["replacements"] == {}
    assert result["accelerator"] == result["cpu"]
    flops = [f for f, *_ in result["cpu"]]
    assert flops == ["2048*B", "0", "0", "12544*B", "0", "128*B"]  # conv, unfold, ..., linears
    assert all("B" in bytes_ for *_, bytes_ in result["cpu"] if bytes_ != "0")
