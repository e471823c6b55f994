"""examples/train_llm.py under torchrun on 2 gloo ranks: the progress lines, an exact resume
from a torch.distributed.checkpoint, and that checkpoint loaded into the unsplit Llama.

Two torchrun runs of a tiny Llama in float32 (`--no-autocast`), shared by the tests: 5 steps
with a checkpoint and a validation at step 3, then `--resume` to step 5 from that checkpoint.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

# with -n, one worker runs this module (pyproject.toml: loadgroup): its fixture runs once
pytestmark = pytest.mark.xdist_group("train-llm")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_llm.py"
STEPS, SAVED = 5, 3
TINY = ["--layers", "2", "--dim", "16", "--heads", "2", "--vocab", "64", "--seq", "8",
        "--batch", "8", "--warmup", "2", "--lr", "3e-3", "--no-autocast",
        "--steps", str(STEPS), "--ckpt-every", str(SAVED), "--val-every", str(SAVED),
        "--ckpt-dir", "ckpt"]
STEP_LINE = re.compile(r"step +(\d+)/(\d+) \| loss (\d+\.\d{8}) \| lr (\d\.\d{3}e-\d\d) \| "
                       r"grad norm (\d+\.\d{4}) \| [\d,]+ tok/s")
VAL_LINE = re.compile(r"val +(\d+)/(\d+) \| loss (\d+\.\d{8})")


def _example():
    spec = importlib.util.spec_from_file_location("train_llm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun(cwd: Path, *extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        # --standalone: torchrun binds a free port itself (none chosen here and bound later)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), *TINY, *extra],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def _steps(out: str, total: int = STEPS) -> dict[int, tuple[str, str, str]]:
    """step -> (loss, lr, grad norm) as printed, from the lines that are progress lines."""
    steps = {}
    for line in out.splitlines():
        if line.startswith("step"):
            match = STEP_LINE.fullmatch(line)
            assert match, f"malformed progress line: {line!r}"
            assert int(match[2]) == total and int(match[1]) not in steps  # rank 0 prints, once
            steps[int(match[1])] = (match[3], match[4], match[5])
    return steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_llm")
    full = _torchrun(tmp)
    resumed = _torchrun(tmp, "--resume")
    return tmp, full, resumed


def test_progress_lines_and_learning_rate_schedule(runs):
    _, full, _ = runs
    steps = _steps(full)
    assert sorted(steps) == list(range(1, STEPS + 1))
    lr_factor = _example().lr_factor
    for step, (loss, lr, norm) in steps.items():
        assert 0 < float(loss) < 2 * math.log(64) and float(norm) > 0
        # the rate each step was taken with: warmup over 2 steps, then cosine towards 0.1 x
        assert lr == f"{3e-3 * lr_factor(step - 1, 2, STEPS):.3e}"
    assert [s[1] for _, s in sorted(steps.items())] == [
        "1.500e-03", "3.000e-03", "3.000e-03", "2.325e-03", "9.750e-04"]
    assert VAL_LINE.search(full)[1] == str(SAVED)
    assert f"saved ckpt{os.sep}step_{SAVED:06d}" in full


def test_resumed_run_repeats_the_uninterrupted_steps_exactly(runs):
    _, full, resumed = runs
    assert f"resumed from ckpt{os.sep}step_{SAVED:06d} at step {SAVED}" in resumed
    after = _steps(resumed)
    assert sorted(after) == list(range(SAVED + 1, STEPS + 1))
    # float32, no autocast, the same plan and batches: loss (printed with 9 significant
    # digits, enough to identify a float32), learning rate and grad norm are the same
    assert after == {s: v for s, v in _steps(full).items() if s > SAVED}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # no process group: intended
def test_checkpoint_loads_into_the_unsplit_model(runs):
    import torch.distributed.checkpoint as dcp

    tmp, full, _ = runs
    example = _example()
    args = example.parse_args(TINY)
    model = example.build_model(args)  # the initial weights, as every rank built them
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"model": model.state_dict(), "trainer": {"step": -1}}
    dcp.load(state, checkpoint_id=str(tmp / "ckpt" / f"step_{SAVED:06d}"), no_dist=True)
    assert state["trainer"]["step"] == SAVED
    assert set(state["model"]) == set(initial)  # the original parameter names
    model.load_state_dict(state["model"])
    assert all(not torch.equal(initial[k], v) for k, v in model.state_dict().items())
    # the unsplit model reproduces the validation loss printed after step 3 (the checkpoint's
    # weights); the mean over equal micro-batches equals the batch mean up to float32 rounding
    x, y = example.batch(args, seed=example.VAL_SEED)
    with torch.no_grad():
        val = example.causal_lm_loss(model.eval()(x), y)
    assert abs(val.item() - float(VAL_LINE.search(full)[3])) < 1e-5


def test_one_process_with_two_workers_matches_the_two_ranks(runs, tmp_path, capsys):
    """Without torchrun the script compiles onto `--devices` CPU workers in one process: the
    same steps as the 2 ranks (up to float32 rounding: this process's matmuls use its own
    intra-op thread count, each rank one thread) and a checkpoint without a process group."""
    _, full, _ = runs
    argv = TINY + ["--devices", "2"]
    argv[argv.index("--steps") + 1] = "2"
    argv[argv.index("--ckpt-every") + 1] = "2"
    argv[argv.index("--ckpt-dir") + 1] = str(tmp_path / "ckpt")
    _example().main(argv)
    out = capsys.readouterr().out
    assert (tmp_path / "ckpt" / "step_000002" / ".metadata").exists()
    steps, ranks = _steps(out, total=2), _steps(full)
    assert sorted(steps) == [1, 2]
    for step, (loss, lr, norm) in steps.items():
        assert abs(float(loss) - float(ranks[step][0])) < 1e-5
        assert lr == ranks[step][1]  # both still in the 2-step warmup
        assert abs(float(norm) - float(ranks[step][2])) <= 2e-4


def test_meta_run_loading_saved_weights_repeats_the_eager_steps(tmp_path, capsys):
    """`--meta --weights DIR`: built on meta, each worker's stages loaded from the
    save_pretrained shards of the model the eager run builds: the same losses and norms."""
    example = _example()
    argv = TINY + ["--devices", "2"]
    argv[argv.index("--steps") + 1] = "2"
    argv[argv.index("--ckpt-every") + 1] = "0"
    example.build_model(example.parse_args(argv)).save_pretrained(
        tmp_path / "weights", max_shard_size="10KB")
    example.main(argv)
    eager = _steps(capsys.readouterr().out, total=2)
    example.main(argv + ["--meta", "--weights", str(tmp_path / "weights")])
    out = capsys.readouterr().out
    assert "loaded this rank's tensors" in out
    assert _steps(out, total=2) == eager
