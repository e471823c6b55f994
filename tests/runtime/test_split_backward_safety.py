"""Zero-bubble W must never run a kernel known to crash: GroupNorm's weight-only backward on a
non-contiguous saved input (torch 2.13 CPU: segmentation fault). Anything that might crash runs
in a subprocess, so a regression fails this test instead of ending pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge

from pipecompile.runtime.split_backward import backward_input

ROOT = Path(__file__).resolve().parents[2]


def _group_norm_stage(contiguous: bool):
    x0 = torch.randn(2, 4, 4, 8, dtype=torch.float64, requires_grad=True)
    x = (x0 * 2).permute(0, 3, 1, 2)
    if contiguous:
        x = x.contiguous()
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    y = F.group_norm(x, 2, w, b)
    return x0, w, b, y


@pytest.mark.parametrize("contiguous", [False, True])
def test_weight_work_asks_group_norm_for_its_input_gradient_only_when_unsafe(contiguous):
    x0, w, b, y = _group_norm_stage(contiguous)
    grads, work = backward_input([y], [torch.ones_like(y)], [x0], [w, b])
    assert grads[0] is not None and x0.grad is None
    (edges, _, inputs), = work.groups
    extra = [e for e in inputs if isinstance(e, GradientEdge)]
    assert [t for t in inputs if isinstance(t, torch.Tensor)] == [w, b]
    assert len(extra) == (0 if contiguous else 1)


def test_zero_bubble_step_through_permuted_group_norm_is_exact():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "tests.support.gn_zero_bubble"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip().endswith("ok")
