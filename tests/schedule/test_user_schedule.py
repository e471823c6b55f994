"""compile(schedule=...) with a hand-written schedule: a `Schedule`, its text or CSV form, or a
file holding one. It runs exactly like the built-in schedule it spells out (loss and gradients
equal to the unsplit model's, float64), and a wrong one is refused at compile time, naming the
action or the counts that disagree."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError, ScheduleError
from pipecompile.schedule.actions import Action, Kind, Schedule
from pipecompile.schedule.lowering import strip_communication
from pipecompile.schedule.schedules import make_schedule, user_schedule
from tests.support.reference import assert_grads_equal, reference_step

# 1F1B (PipeDream-Flush) for 2 devices and 4 micro-batches, written out by hand: stage 0 runs one
# warm-up forward, then alternates; compute actions only (compile adds the messages and STEPs).
ONE_F_ONE_B = """\
name: my-1f1b
# device 0 holds stage 0, device 1 stage 1
0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3
"""


def _gpt():
    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8).double()
    x = torch.randint(0, 64, (8, 8))
    y = torch.randint(0, 64, (8, 8))
    return model, x, y


def _compile(schedule, **options):
    model, x, y = _gpt()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, schedule=schedule, loss_fn=zoo.lm_loss,
                      **options)
    return pipe, reference, x, y


def _check_exact(pipe, reference, x, y, microbatches=4):
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, zoo.lm_loss, microbatches)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-10)) == len(ref_grads)


def test_text_schedule_equals_unsplit_model_and_builtin_1f1b():
    pipe, reference, x, y = _compile(ONE_F_ONE_B)
    # from the schedule ("auto")
    assert pipe.plan.resolved.microbatches == 4 and len(pipe.program.stages) == 2
    builtin, _, _, _ = _compile("1f1b", microbatches=4)
    assert pipe.schedule.name == "my-1f1b"
    assert pipe.schedule.actions == builtin.schedule.actions  # messages and STEPs added alike
    assert pipe.schedule.stage_to_device == builtin.schedule.stage_to_device
    assert pipe.predicted.makespan == pytest.approx(builtin.predicted.makespan, rel=1e-9)
    assert "my-1f1b" in str(pipe) and "my-1f1b" in pipe.explain()
    _check_exact(pipe, reference, x, y)


def test_csv_file_schedule(tmp_path):
    path = tmp_path / "my.csv"
    path.write_text(Schedule.from_text(ONE_F_ONE_B).to_csv())
    pipe, reference, x, y = _compile(str(path), microbatches=4)
    assert pipe.schedule.name == "my-1f1b"
    builtin = strip_communication(make_schedule("1f1b", 2, 4))
    assert strip_communication(pipe.schedule) == replace(builtin, name="my-1f1b")
    _check_exact(pipe, reference, x, y)


def test_schedule_object_from_make_schedule():
    given = make_schedule("gpipe", 2, 4)  # lowered already: its messages are replaced
    pipe, reference, x, y = _compile(given, checkpoint=False)
    assert pipe.schedule.name == "gpipe" and pipe.plan.resolved.microbatches == 4
    _check_exact(pipe, reference, x, y)


@pytest.mark.parametrize("name", ["zb-h1", "zb-v", "interleaved-1f1b"])
def test_split_backward_and_virtual_stages_from_text(name):
    """I/W actions and two stages per device (a V, or interleaved), written as text."""
    written = replace(strip_communication(make_schedule(name, 2, 4)), name=f"my-{name}")
    pipe, reference, x, y = _compile(written.to_text(), checkpoint=False)
    assert len(pipe.program.stages) == written.num_stages
    assert pipe.schedule.stage_to_device == written.stage_to_device
    _check_exact(pipe, reference, x, y)


def test_backward_before_forward_names_the_action():
    text = ONE_F_ONE_B.replace("0: 0F0 0F1 0B0", "0: 0F0 0B1 0F1 0B0").replace("0B1 0F3", "0F3")
    model, x, _ = _gpt()
    with pytest.raises(ScheduleError, match=r"0B1.*comes before 0F1"):
        pc.compile(model, (x,), devices=2, schedule=text, loss_fn=zoo.lm_loss)
    with pytest.raises(ScheduleError, match=r"0B1.*comes before 0F1"):  # lazy: at compile too
        pc.compile(model, devices=2, schedule=text, loss_fn=zoo.lm_loss)


def test_missing_microbatch_and_deadlock_are_refused():
    model, x, _ = _gpt()
    missing = "0: 0F0 0B0 0F1 0B1\n1: 1F0 1B0\nnum_microbatches: 2"
    with pytest.raises(ScheduleError, match="stage 1, micro-batch 1: no forward 1F1"):
        pc.compile(model, (x,), devices=2, schedule=missing, loss_fn=zoo.lm_loss)
    # device 0 waits in 0B0 for 1B0; device 1 runs 1F1 first, which waits for 0F1 after 0B0
    deadlock = "0: 0F0 0B0 0F1 0B1\n1: 1F0 1F1 1B0 1B1"
    with pytest.raises(ScheduleError, match="deadlocks"):
        pc.compile(model, (x,), devices=2, schedule=deadlock, loss_fn=zoo.lm_loss)


def test_counts_that_disagree_name_both_numbers():
    model, x, _ = _gpt()
    with pytest.raises(ConfigError, match=r"4 micro-batches but microbatches=2"):
        pc.compile(model, (x,), devices=2, microbatches=2, schedule=ONE_F_ONE_B,
                   loss_fn=zoo.lm_loss)
    with pytest.raises(ConfigError, match=r"runs on 2 devices but devices=4"):
        pc.compile(model, (x,), devices=4, schedule=ONE_F_ONE_B, loss_fn=zoo.lm_loss)
    with pytest.raises(ConfigError, match=r"virtual_stages=2"):
        pc.compile(model, (x,), devices=2, virtual_stages=2, schedule=ONE_F_ONE_B,
                   loss_fn=zoo.lm_loss)


def test_asynchronous_step_and_unknown_names_are_refused(tmp_path):
    model, x, _ = _gpt()
    asynchronous = "0: 0F0 0B0 0STEP0\n1: 1F0 1B0 1STEP0"
    with pytest.raises(ScheduleError, match="0STEP0 .*synchronous"):
        pc.compile(model, (x,), devices=2, schedule=asynchronous, loss_fn=zoo.lm_loss)
    with pytest.raises(ConfigError, match="'1f1bb' is not supported"):
        pc.compile(model, (x,), devices=2, schedule="1f1bb", loss_fn=zoo.lm_loss)
    with pytest.raises(ConfigError, match="no such file"):
        pc.compile(model, (x,), devices=2, schedule=str(tmp_path / "absent.csv"),
                   loss_fn=zoo.lm_loss)
    with pytest.raises(ScheduleError, match="text line 1: cannot parse action '0X0'"):
        pc.compile(model, (x,), devices=2, schedule="0F0 0X0\n1F0 1B0", loss_fn=zoo.lm_loss)


def test_user_schedule_is_a_generator_output():
    """Pure data: messages dropped, a STEP per stage added, counts checked."""
    lowered = make_schedule("1f1b", 2, 3)
    plain = user_schedule(lowered, 2, 3)
    assert not plain.has_communication
    assert plain.actions[0][-1] == Action(0, Kind.STEP)
    without = Schedule.from_text("0F0 0B0\n1F0 1B0")
    assert user_schedule(without, 2, 1).actions == (
        tuple(map(Action.parse, "0F0 0B0 0STEP".split())),
        tuple(map(Action.parse, "1F0 1B0 1STEP".split())))
    assert make_schedule(without, 2, 1) == replace(make_schedule("gpipe", 2, 1), name="custom")
    with pytest.raises(ScheduleError, match="has 1 micro-batches, but 2 were asked for"):
        user_schedule(without, 2, 2)


def test_a_hand_written_schedule_is_saved_and_loaded(tmp_path):
    pipe, reference, x, y = _compile(ONE_F_ONE_B)
    pipe.save(tmp_path / "saved")
    loaded = pc.load(tmp_path / "saved", loss_fn=zoo.lm_loss)
    assert loaded.schedule == pipe.schedule and loaded.schedule.name == "my-1f1b"
    _check_exact(loaded, reference, x, y)
