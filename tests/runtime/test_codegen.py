"""Codegen: each device row is emitted as straight-line Python (one block per action, no loop
over the actions), compiled under a linecache file name; errors name the device, stage, action
and micro-batch from the generated frame; mis-lowered schedules fail while emitting."""

from __future__ import annotations

import ast
import gc
import linecache
import traceback

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError, StageExecutionError
from pipecompile.runtime.codegen import StageCode, emit, failed_action, load
from pipecompile.runtime.executor import Executor
from pipecompile.runtime.mailbox import Mailbox
from pipecompile.runtime.microbatch import split_microbatches
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.messages import Dataflow, Message

CPU = torch.device("cpu")


def _gpt_pipe(**options):
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=16, layers=4, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    return pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=zoo.lm_loss,
                      **options), x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b",
                                      "pipedream"])
def test_generated_rows_are_straight_line_with_a_block_per_action(schedule):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    pipe = pc.compile(model, (x,), devices=2, microbatches=4, schedule=schedule,
                      loss_fn=torch.nn.functional.mse_loss,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    pipe.step(x, target=x)
    for device in range(pipe.schedule.num_devices):
        source = pipe.runtime_code(device)
        tree = ast.parse(source)
        fn = tree.body[0]
        assert isinstance(fn, ast.FunctionDef) and fn.name == f"device_{device}"
        assert not any(isinstance(n, (ast.For, ast.While, ast.ListComp)) for n in ast.walk(fn))
        actions = pipe.schedule.actions[device]
        comments = [line.strip() for line in source.splitlines()
                    if line.strip().startswith("# ")]
        assert [c.split(":")[0][2:] for c in comments] == [str(a) for a in actions]
        # at least one statement per action besides the docstring and the local bindings
        assert len(fn.body) >= len(actions)


def test_failing_loss_names_device_stage_action_and_microbatch_with_the_generated_line():
    def loss_fn(out, y):
        raise RuntimeError("boom")

    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=16, layers=4, heads=2, seq=8)
    x = torch.randint(0, 32, (8, 8))
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b", loss_fn=loss_fn)
    with pytest.raises(StageExecutionError) as info:
        pipe.step(x, target=x)
    message = str(info.value)
    assert "stage 1 failed in action 1F0 (device 1, micro-batch 0)" in message
    assert "boom" in message
    frames = traceback.extract_tb(info.value.__cause__.__traceback__)
    generated = [f for f in frames if f.filename.startswith("<pipecompile-")]
    assert generated and "w1.forward(0," in generated[-1].line


class _Recorder:
    """A stand-in worker: backward returns fixed input gradients, records what it was given."""

    def __init__(self, inputs, grads=None):
        self.input_names, self.given, self.grads = inputs, [], grads or {}

    def forward(self, mb, inputs, target):
        return {"e1": torch.full((2,), float(mb + 1))}

    def backward(self, mb, grads):
        self.given.append(dict(grads))
        return self.grads


def test_gradient_of_a_value_read_by_two_stages_is_summed():
    # e1 made by stage 0 is read by stages 1 and 3 (a long skip): two backward messages, one sum
    flow = Dataflow.from_wiring({"e1": 0}, {"e1": (1, 3)}, {"e1"}, 4)
    row = [Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0, peer=1),
           Action(0, Kind.SEND_F, 0, peer=3), Action(0, Kind.RECV_B, 0, peer=3),
           Action(0, Kind.RECV_B, 0, peer=1), Action(0, Kind.B, 0)]
    schedule = Schedule("skip", 4, 1, (0, 1, 2, 3), (tuple(row), (), (), ()))
    stages = {0: StageCode(0, ("x",), frozenset({"x"}), False)}
    code = load(emit(schedule, 0, stages, flow))
    box = Mailbox((CPU,) * 4, timeout=5.0)
    box.send(Message(1, 0, 0, True, ("e1",)), {"e1": torch.tensor([1.0, 2.0])})
    box.send(Message(3, 0, 0, True, ("e1",)), {"e1": torch.tensor([10.0, 20.0])})
    worker, records = _Recorder(("x",)), []
    code.fn({0: worker}, (CPU,) * 4, box, None, [{"x": torch.zeros(2)}], [None], {}, records)
    assert torch.equal(worker.given[0]["e1"], torch.tensor([11.0, 22.0]))
    assert [k for k, _, _ in records] == list(range(len(row)))
    for peer in (1, 3):  # the forward values went out to both readers
        assert torch.equal(box.recv(Message(0, peer, 0, False, ("e1",)))["e1"],
                           torch.full((2,), 1.0))


def test_generated_source_is_in_linecache_and_lines_map_to_actions():
    flow = Dataflow.chain(2)
    row = (Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0, peer=1))
    schedule = Schedule("tiny", 2, 1, (0, 1), (row, ()))
    code = load(emit(schedule, 0, {0: StageCode(0, ("x",), frozenset({"x"}), False)}, flow))
    assert "".join(linecache.getlines(code.filename)) == code.source
    line = next(n for n, text in enumerate(code.source.splitlines(), 1) if "transport.send" in text)
    assert code.action_at(line) == row[1]

    class Broken(_Recorder):
        def forward(self, mb, inputs, target):
            raise ValueError("bad input")

    with pytest.raises(ValueError) as info:
        code.fn({0: Broken(("x",))}, (CPU, CPU), Mailbox((CPU, CPU), timeout=1.0), None,
                [{"x": 1}], [None], {}, [])
    assert failed_action(code, info.value.__traceback__) == row[0]


def test_a_forward_without_its_receive_fails_while_emitting():
    flow = Dataflow.from_wiring({"h": 0}, {"h": (1,)}, {"h"}, 2)
    schedule = Schedule("no-recv", 2, 1, (0, 1), ((), (Action(1, Kind.F, 0),)))
    stages = {1: StageCode(1, ("h",), frozenset(), True)}
    with pytest.raises(StageExecutionError, match="stage 1 has no value 'h' for micro-batch 0"
                                                  ".* no receive from stage 0"):
        emit(schedule, 1, stages, flow)


def test_a_send_of_nothing_fails_while_emitting():
    flow = Dataflow.chain(2)
    schedule = Schedule("no-f", 2, 1, (0, 1), ((Action(0, Kind.SEND_F, 0, peer=1),), ()))
    with pytest.raises(StageExecutionError, match="0SEND_F0>1 has nothing to send"):
        emit(schedule, 0, {0: StageCode(0, ("x",), frozenset({"x"}), False)}, flow)


def test_one_thread_interleaving_reports_a_deadlock_naming_the_blocked_actions():
    pipe, x = _gpt_pipe(schedule="1f1b")
    rows = [list(r) for r in pipe.schedule.actions]
    # device 0 waits for micro-batch 0's gradient before sending its values: neither moves
    first = next(i for i, a in enumerate(rows[0]) if a.kind is Kind.RECV_B)
    rows[0].insert(0, rows[0].pop(first))
    swapped = Schedule(pipe.schedule.name, pipe.schedule.num_stages,
                       pipe.schedule.num_microbatches, pipe.schedule.stage_to_device, rows)
    pipe.runtime.executor.threads = False
    mbs = split_microbatches((x,), {}, x, 2)
    with pytest.raises(StageExecutionError, match="cannot progress: blocked on"):
        pipe.runtime.run(swapped, mbs, batches=1)


def test_save_and_load_regenerate_the_same_code(tmp_path):
    pipe, x = _gpt_pipe(schedule="1f1b")
    pipe.step(x, target=x)
    before = [pipe.runtime_code(d) for d in range(pipe.schedule.num_devices)]
    pipe.save(tmp_path / "p")
    loaded = pc.load(tmp_path / "p", loss_fn=zoo.lm_loss)
    assert [loaded.runtime_code(d) for d in range(loaded.schedule.num_devices)] == before


def test_an_executor_generates_only_the_rows_it_runs():
    pipe, _ = _gpt_pipe(schedule="1f1b")
    executor = Executor(pipe.runtime.workers, pipe.runtime.wiring, rows=[1])
    with pytest.raises(ConfigError, match="device 0 is not run by this process"):
        executor.code(pipe.schedule, 0)
    assert executor.code(pipe.schedule, 1) == pipe.runtime_code(1)


def test_an_accelerator_stage_publishes_its_values_after_forward_and_backward():
    # on CUDA each device thread has its own stream: values leave it only once computed
    flow = Dataflow.from_wiring({"h": 0}, {"h": (1,)}, {"h"}, 2)
    row = (Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0, peer=1),
           Action(0, Kind.RECV_B, 0, peer=1), Action(0, Kind.B, 0))
    schedule = Schedule("cuda", 2, 1, (0, 1), (row, ()))
    lines = [line.strip() for line in emit(
        schedule, 0, {0: StageCode(0, ("x",), frozenset({"x"}), False, accelerator=True)},
        flow).source.splitlines()]
    forward = next(i for i, line in enumerate(lines) if line.startswith("o = w0.forward"))
    backward = next(i for i, line in enumerate(lines) if line.startswith("g = w0.backward"))
    assert lines[forward + 1] == "publish(d0)"
    assert "publish(d0)" in lines[backward + 1:backward + 3]
    cpu = emit(schedule, 0, {0: StageCode(0, ("x",), frozenset({"x"}), False)}, flow)
    assert "publish" not in cpu.source


def test_the_linecache_entry_goes_with_the_generated_code():
    flow = Dataflow.chain(2)
    row = (Action(0, Kind.F, 0), Action(0, Kind.SEND_F, 0, peer=1))
    schedule = Schedule("short-lived", 2, 1, (0, 1), (row, ()))
    code = load(emit(schedule, 0, {0: StageCode(0, ("x",), frozenset({"x"}), False)}, flow))
    filename = code.filename
    assert filename in linecache.cache
    del code
    gc.collect()
    assert filename not in linecache.cache
