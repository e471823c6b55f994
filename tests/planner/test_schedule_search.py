"""The planning search (pipecompile/planner/schedule_search.py) on synthetic cost tables, and compile's "auto"
defaults end to end: exact training, per-stage recomputation, explain(), the CLI, save/load."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecompile as pc
from pipecompile.cli import main
from pipecompile.ir.devices import DeviceSpec
from pipecompile.passes.partition import PartitionMemoryError
from pipecompile.pipeline import Pipeline
from pipecompile.planner.schedule_search import (
    NOT_SIMULATED, SYNC_SCHEDULES, TIE, BlockTable, Outpaced, Space, microbatch_choices, search)
from pipecompile.schedule.bounds import fill_floor
from tests.support.models import gpt
from tests.support.reference import assert_grads_equal, reference_step
from tests.test_cli import FACTORIES

BATCH = 16


def _table(n=8, *, forward=1e-3, static=0.0, activation=0.0, cut=0.0, m=1) -> BlockTable:
    """n equal blocks; times and activations per micro-batch of BATCH / m samples."""
    return BlockTable(forward=(forward / m,) * n, backward_input=(forward / m,) * n,
                      backward_weight=(forward / m,) * n, static_bytes=(static,) * n,
                      activation_bytes=(activation / m,) * n,
                      cut_bytes=(0.0,) + (cut / m,) * (n - 1) + (0.0,))


def _search(space, devices=2, *, table=None, **options):
    return search(space, [DeviceSpec()] * devices,
                  lambda m, stages: _table(m=m, **(table or {})), **options)


def test_microbatch_choices_divide_the_batch_and_are_capped():
    assert microbatch_choices(16) == (1, 2, 4, 8, 16)
    assert microbatch_choices(12) == (1, 2, 3, 4, 6, 12)
    assert microbatch_choices(720) == (1, 2, 4, 8, 16, 30)  # powers of two and the largest


def test_a_large_fixed_cost_per_action_makes_fewer_microbatches_win():
    space = Space(SYNC_SCHEDULES, microbatch_choices(BATCH))
    slow_dispatch = _search(space, overhead=10e-3)
    assert slow_dispatch.best.microbatches == 1
    free_dispatch = _search(space, overhead=0.0)
    assert free_dispatch.best.microbatches == 16
    assert free_dispatch.best.step < slow_dispatch.best.step
    assert free_dispatch.lower_bound == pytest.approx(16 * 8 * 3e-3 / 16 / 2)


def test_the_lower_bound_counts_the_cores_device_threads_share():
    """4 device threads of which the cores run 2 at a time, at 0.8 of their speed: the bound
    is the compute over 2 x 0.8 devices' worth, and explain says so."""
    space = Space(("1f1b",), (4,))
    free = search(space, [DeviceSpec()] * 4, lambda m, s: _table(m=m))
    shared = search(space, [DeviceSpec()] * 4, lambda m, s: _table(m=m), cores=2,
                    efficiency=0.8)
    compute = 4 * 8 * 3e-3 / 4  # m micro-batches of 8 blocks (F + I + W), per micro-batch
    assert free.lower_bound == pytest.approx(compute / 4)
    assert shared.lower_bound == pytest.approx(compute / (2 * 0.8))
    assert "cores run 2 at a time at 0.80" in shared.bound_note
    assert free.bound_note == "compute / devices, no bubble, no overhead"


def test_memory_limit_recomputes_exactly_the_stages_that_need_it():
    # 1F1B on 2 devices, 4 micro-batches: stage 0 holds 2 in flight, stage 1 holds 1. Four
    # blocks of 1 MB activations each: balanced, stage 0 needs 4 MB (2 with recomputation),
    # stage 1 needs 2 MB; a 3 MB limit makes recomputing stage 0 the fastest plan that fits.
    space = Space(("1f1b",), (4,), (1,), checkpoint=None)
    table = _table(4, activation=4e6, m=4)  # 1 MB per block and micro-batch of 4 samples
    unlimited = search(space, [DeviceSpec()] * 2, lambda m, s: table)
    assert unlimited.best.recompute == (False, False)
    limited = search(space, [DeviceSpec(memory=3e6)] * 2, lambda m, s: table)
    assert limited.best.recompute == (True, False)
    assert limited.best.bounds == (0, 2, 4)
    assert limited.best.memory == (2e6, 2e6)
    assert limited.best.step > unlimited.best.step  # the forward runs again
    never = search(replace(space, checkpoint=False), [DeviceSpec(memory=3e6)] * 2,
                   lambda m, s: table)
    assert never.best.recompute == (False, False) and never.best.bounds == (0, 1, 4)


def test_no_plan_fits_names_the_need_and_the_fixes():
    space = Space(SYNC_SCHEDULES, (1, 2, 4), checkpoint=None)
    with pytest.raises(PartitionMemoryError) as error:
        search(space, [DeviceSpec(memory=1e6)] * 2, lambda m, s: _table(static=1e6))
    message = str(error.value)
    assert "no plan fits in memory on 2 devices" in message
    assert "3.82 MiB" in message  # the smallest plan: 4 blocks of 1 MB static on a device
    assert "use 8 devices (the fewest that fit)" in message
    assert "recomputation on every stage does not suffice" in message
    assert "smaller micro-batches" in message
    assert error.value.memory_needed == 4e6 and error.value.devices_needed == 8


def test_search_is_deterministic_and_breaks_ties_in_order():
    space = Space(SYNC_SCHEDULES, microbatch_choices(BATCH), checkpoint=None)
    first, second = _search(space, overhead=1e-3), _search(space, overhead=1e-3)
    assert first == second
    # one micro-batch: gpipe and 1F1B are the same timeline; gpipe is listed first
    tie = _search(Space(("1f1b", "gpipe"), (1,)), overhead=1e-3)
    assert [c.schedule for c in tie.candidates] == ["1f1b", "gpipe"]
    assert tie.candidates[1].reason == "tie (later in order)"


def test_a_tie_goes_to_the_plan_that_holds_less_memory():
    # two micro-batches on two devices: gpipe and 1F1B run the same timeline, but 1F1B's last
    # stage holds one micro-batch's activations instead of two
    tie = _search(Space(("gpipe", "1f1b"), (2,)), overhead=1e-3, table={"activation": 4e6})
    f1b, gpipe = sorted(tie.candidates, key=lambda c: c.schedule)
    assert gpipe.step == pytest.approx(f1b.step, rel=1e-9)
    assert sum(f1b.memory) < sum(gpipe.memory)
    assert tie.best.schedule == "1f1b" and tie.candidates[1].reason == "tie (more memory)"


def test_explicit_values_are_the_only_ones_costed():
    result = _search(Space(("zb-h1",), (4,)), overhead=1e-4)
    assert [(c.schedule, c.microbatches) for c in result.candidates] == [("zb-h1", 4)]


def test_plans_bounded_over_a_step_found_are_not_simulated_and_the_winner_is_the_same():
    """`above`: the plans whose bound is over the best step (of this search, or the one given)
    are listed unsimulated; the winner and its step are those of the full search, and each
    plan skipped is slower than it in the full search. Nothing as fast as `above`: Outpaced."""
    space = Space(SYNC_SCHEDULES, microbatch_choices(BATCH), interleave=(2,))
    every = _search(space, 4, overhead=1e-4)
    pruned = _search(space, 4, overhead=1e-4, above=float("inf"))
    assert pruned.best == every.best and pruned.lower_bound == every.lower_bound
    full = {(c.schedule, c.microbatches, c.virtual_stages): c for c in every.candidates}
    skipped = [c for c in pruned.candidates if c.reason.startswith(NOT_SIMULATED)]
    assert skipped and len(pruned.candidates) == len(every.candidates)
    assert pruned.candidates[-len(skipped):] == tuple(skipped)  # listed last
    for c in skipped:
        assert not c.fits and full[c.schedule, c.microbatches, c.virtual_stages].step > (
            every.best.step * (1 + TIE))
    simulated = [c for c in pruned.candidates if c not in skipped]
    assert all(full[c.schedule, c.microbatches, c.virtual_stages].step == c.step
               for c in simulated)
    given = _search(space, 4, overhead=1e-4, above=every.best.step)
    assert given.best == every.best
    with pytest.raises(Outpaced) as raised:
        _search(space, 4, overhead=1e-4, above=every.best.step / 2)
    assert every.best.step / 2 < raised.value.floor <= every.best.step


def test_interleaving_tries_every_virtual_stage_count_asked():
    # 2 devices, 8 equal blocks, m = 4: interleaved 1F1B's bubble (p-1)/(v m + p-1) shrinks
    # with v, so one block per stage (v = 4) is the fastest; the others keep their own v
    space = Space(("1f1b", "interleaved-1f1b", "zb-v"), (4,), interleave=(2, 3, 4))
    assert space.virtual_for("interleaved-1f1b") == (2, 3, 4)
    assert space.virtual_for("zb-v") == (2,) and space.virtual_for("1f1b") == (1,)
    result = _search(space, overhead=0.0)
    tried = {(c.schedule, c.virtual_stages) for c in result.candidates}
    assert tried == {("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                     ("interleaved-1f1b", 4), ("zb-v", 2)}
    steps = {c.virtual_stages: c.step for c in result.candidates
             if c.schedule == "interleaved-1f1b" and c.fits}
    assert steps[4] < steps[2]
    assert Space(("interleaved-1f1b",), (4,), virtual_stages=(2,),
                 interleave=(2, 3)).virtual_for("interleaved-1f1b") == (2,)  # given wins


def _compile_gpt(**options):
    torch.manual_seed(0)
    case = gpt()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=2, loss_fn=case.loss_fn, **options)
    return case, reference, pipe


def _assert_trains_like_unsplit(case, reference, pipe):
    loss = pipe.step(*case.args, target=case.target)
    ref_loss, ref_grads = reference_step(reference, case.args, {}, case.target, case.loss_fn,
                                         pipe.plan.resolved.microbatches)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0), (loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads)) == len(ref_grads)


def test_compile_with_only_defaults_searches_and_trains_like_the_unsplit_model():
    case, reference, pipe = _compile_gpt()
    search_ = pipe.plan.search
    assert search_ is not None
    assert search_.searched == ("checkpoint", "microbatches", "schedule", "virtual_stages")
    best = search_.best
    options = pipe.plan.resolved
    assert (options.schedule, options.microbatches, options.virtual_stages) == (
        best.schedule, best.microbatches, best.virtual_stages)
    assert options.checkpoint == best.recompute == (False,) * len(pipe.program.stages)
    assert pipe.predicted.makespan == pytest.approx(best.step, rel=1e-9)
    _assert_trains_like_unsplit(case, reference, pipe)


def test_explicit_schedule_searches_only_the_microbatches():
    _, _, pipe = _compile_gpt(schedule="1f1b")
    assert {c.schedule for c in pipe.plan.search.candidates} == {"1f1b"}
    assert {c.microbatches for c in pipe.plan.search.candidates} == {1, 2, 4, 8}
    assert pipe.plan.search.searched == ("checkpoint", "microbatches")


def test_one_stage_recomputes_and_the_other_not_exactly(tmp_path):
    case, reference, pipe = _compile_gpt(schedule="1f1b", microbatches=4, checkpoint=False)
    plan = pipe.plan
    mixed = Pipeline(replace(plan, resolved=replace(plan.resolved, checkpoint=(True, False))))
    assert [w.checkpoint for w in mixed.runtime.workers.values()] == [True, False]
    _assert_trains_like_unsplit(case, reference, mixed)
    loaded = pc.load(mixed.save(tmp_path / "saved"), loss_fn=case.loss_fn)
    assert loaded.plan.resolved.checkpoint == (True, False)
    assert [w.checkpoint for w in loaded.runtime.workers.values()] == [True, False]


def test_memory_limit_makes_compile_recompute_only_where_needed():
    _, _, free = _compile_gpt(schedule="1f1b", microbatches=4)
    assert free.plan.resolved.checkpoint == (False, False)
    stage0 = free.program.stages[0].cost.memory
    # just below stage 0's need: it holds 2 micro-batches in flight, stage 1 only one
    case, reference, pipe = _compile_gpt(schedule="1f1b", microbatches=4,
                                         memory_limit=stage0 * 0.999)
    assert pipe.plan.resolved.checkpoint == (True, False)
    assert "recompute stages [0]" in pipe.explain()
    _assert_trains_like_unsplit(case, reference, pipe)


def test_explain_shows_the_candidates_or_that_nothing_was_searched():
    _, _, pipe = _compile_gpt()
    text = pipe.explain()
    assert "search " in text and "plan: " in text and "above the lower bound" in text
    assert "chosen" in text and "slower (+" in text
    _, _, given = _compile_gpt(schedule="gpipe", microbatches=2, checkpoint=False)
    assert "nothing searched" in given.explain()


def test_cli_plan_prints_the_candidate_table(capsys):
    status = main(["plan", f"{FACTORIES}:keyword_tuple", "--devices", "2"])
    out = capsys.readouterr().out
    assert status == 0
    assert "plan: " in out and "verdict" in out and "chosen" in out


def test_calibration_scales_the_loss_time_with_the_microbatch_size():
    from pipecompile.passes.calibrate import Calibration

    measured = Calibration(1.5, 2e-3, microbatch_size=4)
    assert measured.at(8) == Calibration(1.5, 4e-3, microbatch_size=8)
    assert measured.at(4) is measured
    assert Calibration(1.5, 2e-3).at(8) == Calibration(1.5, 2e-3)  # size unknown: as given


def _probed(monkeypatch, found, microbatches, **options):
    """Compiled with the probe's result `found`; micro-batches "auto" with one choice, since
    the probe only runs when a searched option depends on time. No fixed cost per action: the
    one this machine measures grows with its load, and would decide the ratios compared."""
    import pipecompile.planner.shape_passes as choose

    monkeypatch.setattr(choose, "probe", lambda *args, **kwargs: found)
    monkeypatch.setattr(choose, "action_cost", lambda *args, **kwargs: 0.0)
    monkeypatch.setattr(choose, "microbatch_choices", lambda batch: (microbatches,))
    return _compile_gpt(microbatches="auto", **options)[2]


def test_the_search_prices_candidates_with_the_probed_measurements(monkeypatch):
    """What the probe measured (a fake one here) is what the search and the final prediction
    use: the block-time factor, zero-bubble's (I + W) / B and the device threads' efficiency."""
    from pipecompile.passes.calibrate import Calibration
    from pipecompile.measure.probe import Probe

    plain = _probed(monkeypatch, Probe(Calibration(1.0), 1.0, 1.0), schedule="1f1b",
                    microbatches=2)
    slower = _probed(monkeypatch, Probe(Calibration(3.0), 1.0, 1.0), schedule="1f1b",
                     microbatches=2)
    compute = plain.plan.search.lower_bound
    assert slower.plan.search.lower_bound == pytest.approx(3 * compute, rel=1e-9)
    assert "measured: block times x3.00" in slower.explain()
    assert slower.plan.calibration == Calibration(3.0)

    zb = {}
    for ratio in (1.0, 3.0):
        pipe = _probed(monkeypatch, Probe(Calibration(1.0), ratio, 1.0), schedule="zb-h1",
                       microbatches=2)
        zb[ratio] = pipe.plan.search.best.step
        assert pipe.plan.split_ratio == ratio
        assert pipe.predicted.makespan == pytest.approx(zb[ratio], rel=1e-9)
    assert zb[3.0] > 1.25 * zb[1.0]  # backward is most of the step

    alone = _probed(monkeypatch, Probe(Calibration(1.0), 1.0, 1.0), schedule="gpipe",
                    microbatches=4)
    contended = _probed(monkeypatch, Probe(Calibration(1.0), 1.0, 0.5), schedule="gpipe",
                        microbatches=4)
    assert contended.plan.efficiency == 0.5
    assert contended.plan.search.best.step > alone.plan.search.best.step


def test_no_probe_when_only_recomputation_is_searched(monkeypatch):
    """Schedule and micro-batches given: memory alone decides recomputation, so compile runs
    no probe (its passes would only cost time) and predicts analytically."""
    import pipecompile.planner.shape_passes as choose

    def fail(*args, **kwargs):
        raise AssertionError("the probe ran")

    monkeypatch.setattr(choose, "probe", fail)
    pipe = _compile_gpt(schedule="1f1b", microbatches=2)[2]
    assert pipe.plan.calibration is None and "measured:" not in pipe.explain()
    with pytest.raises(AssertionError, match="the probe ran"):
        _compile_gpt(schedule="1f1b")  # micro-batches searched: their times matter


def test_the_probe_measures_the_model_as_it_runs():
    """Lazily compiled, the first step's target is known: the loss is timed on its own."""
    torch.manual_seed(0)
    case = gpt()
    pipe = pc.compile(case.model, devices=2, loss_fn=case.loss_fn)
    pipe.step(*case.args, target=case.target)
    plan = pipe.plan
    assert plan.calibration is not None and plan.calibration.factor > 0
    assert plan.calibration.loss_time > 0
    assert case.args[0].shape[0] == 8 and plan.calibration.microbatch_size == 2  # at m = 4
    assert plan.split_ratio > 0 and plan.efficiency > 0  # timings: their size is the machine's
    assert "measured: block times" in pipe.explain()
    assert plan.calibration.loss_timed and "loss not timed" not in pipe.explain()


def test_without_a_target_explain_says_the_loss_was_not_timed():
    """Compiled eagerly from inputs alone, the probe cannot run the loss: explain() says so
    (and how to give it a target) instead of showing a loss time of 0."""
    torch.manual_seed(0)
    case = gpt()
    pipe = pc.compile(case.model, case.args, devices=2, loss_fn=case.loss_fn)
    assert pipe.plan.calibration is not None and not pipe.plan.calibration.loss_timed
    assert pipe.plan.calibration.loss_time == 0.0
    assert "loss not timed (no target at compile" in pipe.explain()
    assert "example_target=" in pipe.explain()


def test_a_loaded_pipeline_keeps_the_candidate_table(tmp_path):
    case, _, pipe = _compile_gpt()
    loaded = pc.load(pipe.save(tmp_path / "saved"), loss_fn=case.loss_fn)
    assert loaded.plan.search == pipe.plan.search
    assert loaded.plan.split_ratio == pipe.plan.split_ratio
    # the candidate table, up to the asked-beside-resolved table (a loaded plan's request is
    # not saved: "(loaded plan)" there)
    table = pipe.explain().split("plan: ", 1)[1].split("\noption ", 1)[0]
    assert table in loaded.explain() and "chosen" in table


@settings(max_examples=60, deadline=None)
@given(times=st.lists(st.tuples(st.floats(1e-4, 1e-2), st.floats(1e-4, 2e-2)),
                      min_size=4, max_size=10),
       p=st.integers(1, 4), m=st.integers(1, 8), overhead=st.sampled_from([0.0, 1e-4]))
def test_the_fill_floor_is_under_every_gpipe_and_1f1b_step(times, p, m, overhead):
    """gpipe and 1f1b are skipped by `fill_floor` before placing them: it must stay under the
    step the search simulates, whatever the blocks' costs (the placement is optimal)."""
    n = len(times)
    p = min(p, n)
    table = BlockTable(forward=tuple(f for f, _ in times),
                       backward_input=tuple(b / 2 for _, b in times),
                       backward_weight=tuple(b / 2 for _, b in times),
                       static_bytes=(0.0,) * n, activation_bytes=(0.0,) * n,
                       cut_bytes=(0.0,) * (n + 1))
    devices = [DeviceSpec()] * p
    result = search(Space(("gpipe", "1f1b"), (m,)), devices, lambda mb, stages: table,
                    overhead=overhead)
    for c in result.candidates:
        floor = fill_floor(c.schedule, p, m, 1, sum(f + b for f, b in times))
        assert c.fits and c.step >= floor * (1 - 1e-12)
        assert floor >= m * sum(f + b for f, b in times) / p * (1 - 1e-12)  # above the work

