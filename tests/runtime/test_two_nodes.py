"""Two torchrun launchers (`--nnodes 2 --nproc-per-node 2`, c10d rendezvous on 127.0.0.1), as
two machines would run them: examples/train_fsdp.py's pipeline x FSDP steps equal the unsplit
model's (float64)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from pipecompile import zoo
from pipecompile.weights.materialize import init_weights
from tests.distributed.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_fsdp.py"
STEPS = 2


def _example():
    spec = importlib.util.spec_from_file_location("train_fsdp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference() -> tuple[list[float], list[float]]:
    example = _example()
    net = zoo.GPT(vocab=64, dim=32, layers=4, heads=2, seq=8).double()
    torch.manual_seed(0)
    init_weights(net, dict(net.named_parameters(remove_duplicate=False)))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = example.global_batch(step, 8)
        total = 0.0
        for xs, ys in zip(x.chunk(4), y.chunk(4)):  # 2 replicas x 2 micro-batches
            loss = zoo.lm_loss(net(xs), ys) / 4
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
    return losses, norms


def test_two_launchers_run_pipeline_x_fsdp_exactly(tmp_path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-id", "pipecompile-test",
         "--rdzv-endpoint", f"127.0.0.1:{port}", str(SCRIPT), "--steps", str(STEPS),
         "--double", "--out", str(tmp_path / "out.json")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=900)[0] for p in launchers]
    for p, out in zip(launchers, outputs):
        assert p.returncode == 0, out[-4000:]
    result = json.loads((tmp_path / "out.json").read_text())
    losses, norms = _reference()
    assert len(result["losses"]) == STEPS
    for got, want in zip(result["losses"], losses):
        assert abs(got - want) < 1e-12, (result, losses)
    for got, want in zip(result["norms"], norms):
        assert abs(got - want) < 1e-10 * want, (result, norms)
