"""Tests of pipecompile.passes.partition against literal cases and a brute-force reference."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from itertools import combinations

import pytest

from pipecompile.errors import PartitionError
from pipecompile.ir.devices import DeviceSpec
from pipecompile.passes.partition import (
    Partition,
    PartitionMemoryError,
    PartitionProblem,
    balanced_by,
    evaluate,
    lower_bound,
    partition,
    stage_memory,
    stage_time,
    uniform_bounds,
)
from pipecompile.ir.formats import format_bytes

GiB = 2**30


def one_f_one_b(p: int) -> tuple[int, ...]:
    return tuple(p - j for j in range(p))


def simple(times, *, p, devices=None, **kw) -> PartitionProblem:
    n = len(times)
    fields = dict(cut_bytes=(0,) * (n + 1), static_bytes=(0,) * n, activation_bytes=(0,) * n,
                  devices=devices or (DeviceSpec(),) * p, inflight=one_f_one_b(p))
    fields.update(kw)
    return PartitionProblem(block_times=tuple(times), **fields)


# --- brute-force reference, written independently of the DP -----------------------------------

def all_bounds(n: int, p: int):
    for cuts in combinations(range(1, n), p - 1):
        yield (0, *cuts, n)


def ref_costs(pr: PartitionProblem, bounds):
    """(times, memory) with direct sums rather than the module's prefix sums."""
    times, mems = [], []
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        d = pr.devices[j]
        times.append(sum(pr.block_times[a:b]) / d.speed
                     + (pr.cut_bytes[a] + pr.cut_bytes[b]) / d.bandwidth)
        mems.append(sum(pr.static_bytes[a:b])
                    + pr.inflight[j] * (sum(pr.activation_bytes[a:b]) + pr.cut_bytes[a]))
    return times, mems


def fits(pr, mems):
    return all(m <= d.memory for m, d in zip(mems, pr.devices))


def ref_devices_needed(pr: PartitionProblem) -> int | None:
    n, p = len(pr.block_times), len(pr.devices)
    for q in range(p + 1, n + 1):
        more = replace(pr, devices=pr.devices + (pr.devices[-1],) * (q - p),
                       inflight=one_f_one_b(q))
        if any(fits(more, ref_costs(more, bounds)[1]) for bounds in all_bounds(n, q)):
            return q
    return None


def random_problem(rng: random.Random, n: int, p: int) -> PartitionProblem:
    # Byte counts are integers, so sums are exact and tight memory limits are meaningful.
    static = tuple(float(rng.randint(0, 100)) for _ in range(n))
    act = tuple(float(rng.randint(0, 50)) for _ in range(n))
    cut = (0.0, *(float(rng.randint(0, 40)) for _ in range(n - 1)), 0.0)
    inflight = one_f_one_b(p) if rng.random() < 0.7 else tuple(rng.randint(0, 4) for _ in range(p))
    scale = (sum(static) + p * (sum(act) + sum(cut))) / p
    if rng.random() < 0.5:  # heterogeneous: any device may be too small even for one block
        memories = [rng.choice([math.inf, float(rng.randint(0, int(2 * scale) + 1))])
                    for _ in range(p)]
    else:  # one tight limit for all: more devices often help
        memories = [float(rng.randint(int(0.5 * scale), int(1.5 * scale) + 1))] * p
    devices = tuple(
        DeviceSpec(name=f"d{j}",
                   speed=rng.choice([1.0, rng.uniform(0.3, 3.0)]),
                   memory=memories[j],
                   bandwidth=rng.choice([math.inf, rng.uniform(5.0, 200.0)]))
        for j in range(p))
    times = tuple(rng.choice([0.0, rng.uniform(0.0, 10.0), rng.expovariate(0.2)])
                  for _ in range(n))
    return PartitionProblem(block_times=times, cut_bytes=cut, static_bytes=static,
                            activation_bytes=act, devices=devices, inflight=inflight)


def test_dp_matches_brute_force():
    rng = random.Random(1234)
    outcomes = {"fits": 0, "memory, more devices fit": 0, "memory, none fits": 0}
    for _ in range(400):
        n = rng.randint(1, 9)
        p = rng.randint(1, min(4, n))
        pr = random_problem(rng, n, p)
        scored = [(bounds, *ref_costs(pr, bounds)) for bounds in all_bounds(n, p)]
        feasible = [(max(t), sum(x * x for x in t)) for _, t, m in scored if fits(pr, m)]
        if feasible:
            outcomes["fits"] += 1
            best = min(mx for mx, _ in feasible)
            got = partition(pr)
            assert got.bottleneck == pytest.approx(best, rel=1e-9, abs=1e-12)
            _, times, mems = next(s for s in scored if s[0] == got.bounds)
            assert fits(pr, mems)
            assert got.stage_times == pytest.approx(times, rel=1e-9, abs=1e-12)
            # Tie-break: smallest sum of squares among the optimal bottlenecks.
            even = min(sq for mx, sq in feasible if mx <= best * (1 + 1e-9))
            assert sum(x * x for x in got.stage_times) == pytest.approx(even, rel=1e-9, abs=1e-12)
        else:
            with pytest.raises(PartitionMemoryError) as info:
                partition(pr, inflight_for=one_f_one_b)
            assert info.value.memory_needed == min(max(m) for _, _, m in scored)
            assert info.value.devices_needed == ref_devices_needed(pr)
            outcomes["memory, none fits" if info.value.devices_needed is None
                     else "memory, more devices fit"] += 1
    assert min(outcomes.values()) >= 20, outcomes  # both branches well exercised


# --- literal cases ------------------------------------------------------------------------------

def test_literal_case():
    got = partition(simple([1, 2, 3, 4, 5, 6], p=3))
    assert got == Partition(bounds=(0, 3, 5, 6), stage_times=(6.0, 9.0, 6.0),
                            stage_memory=(0.0, 0.0, 0.0))
    assert got.bottleneck == 9.0 and got.num_stages == 3 and got.stage_blocks(1) == range(3, 5)


def test_tie_break_prefers_even_stages():
    # Bottleneck 6 (block 0 alone) either way; (6, 2, 3) is more even than (6, 4, 1).
    assert partition(simple([6, 2, 2, 1], p=3)).bounds == (0, 1, 2, 4)


def test_heavy_last_block_gets_its_own_stage():
    # Eight equal blocks and an LM head three times as slow: equal block counts put the head
    # with another block (bottleneck 4); balancing time gives it a stage of its own.
    pr = simple([1.0] * 8 + [3.0], p=4)
    got = partition(pr)
    assert got.bottleneck == 3.0 == lower_bound(pr)
    assert got.stage_blocks(3) == range(8, 9)
    assert sorted(b - a for a, b in zip(got.bounds, got.bounds[1:])) == [1, 2, 3, 3]
    assert evaluate(pr, uniform_bounds(9, 4)).bottleneck == 4.0


def test_heterogeneous_speeds_and_transfers():
    fast, slow = DeviceSpec("fast", speed=2.0), DeviceSpec("slow", speed=1.0)
    got = partition(simple([1.0] * 6, p=2, devices=(fast, slow)))
    assert got.bounds == (0, 4, 6) and got.stage_times == (2.0, 2.0)
    # Over a slow link the even cut (at 2, 3 bytes: 2 + 3 s per stage) loses to cutting at 1.
    linked = DeviceSpec(bandwidth=1.0)
    pr = simple([1.0] * 4, p=2, devices=(linked, linked), cut_bytes=(0, 0, 3, 0.5, 0))
    assert partition(pr).bounds == (0, 1, 4)
    assert stage_time(pr, 0, 0, 1) == 1.0 and stage_time(pr, 1, 1, 4) == 3.0
    assert stage_time(pr, 0, 0, 2) == 5.0


def test_memory_limit_moves_the_cut():
    # Balanced time would be (0, 2, 4), but stage 0 holds 2 micro-batches and can fit one block.
    pr = simple([1.0] * 4, p=2, static_bytes=(10,) * 4, activation_bytes=(5,) * 4,
                devices=(DeviceSpec(memory=20), DeviceSpec(memory=100)))
    got = partition(pr)
    assert got.bounds == (0, 1, 4)
    assert got.stage_memory == (20.0, 45.0)
    assert (stage_memory(pr, 0, 0, 1), stage_memory(pr, 1, 1, 4)) == (20.0, 45.0)


# --- errors -------------------------------------------------------------------------------------

def test_too_many_stages():
    message = "3 blocks cannot fill 4 stages; use at most 3 devices or finer blocks"
    with pytest.raises(PartitionError, match=message):
        partition(simple([1, 1, 1], p=4))
    with pytest.raises(PartitionError, match="cannot fill"):
        uniform_bounds(2, 3)
    with pytest.raises(PartitionError, match="cannot fill"):
        balanced_by([1, 2], 3)
    with pytest.raises(ValueError, match="at least one stage"):
        uniform_bounds(4, 0)


def test_memory_error_says_what_fits():
    # 8 blocks of 1 GiB static each; 1F1B so stage j holds p - j micro-batches of activations.
    n, p = 8, 2
    pr = simple([1.0] * n, p=p, static_bytes=(GiB,) * n, activation_bytes=(GiB // 4,) * n,
                devices=(DeviceSpec(memory=4 * GiB),) * p)
    with pytest.raises(PartitionMemoryError) as info:
        partition(pr, inflight_for=one_f_one_b)
    err = info.value
    # Best split (0, 4, 8): stage 0 = 4 + 2*1 = 6 GiB; (0, 3, 8): 3 + 1.5 = 4.5 vs 5 + 1.25 = 6.25.
    assert err.memory_needed == 6 * GiB
    # Four stages: (0,2,4,6,8) needs 2 + 4*0.5 = 4 GiB on stage 0; three cannot fit.
    assert err.devices_needed == 4
    assert str(err) == (
        "no placement of 8 blocks on 2 devices fits in memory (each device has 4.00 GiB); the "
        "best placement needs 6.00 GiB on its fullest device. To fix: use devices with at least "
        "6.00 GiB; use 4 devices (the fewest that fit); save memory (fewer micro-batches in "
        "flight, activation checkpointing).")
    with pytest.raises(ValueError) as info:  # what a user who knows only ValueError catches
        partition(pr)
    assert info.value.devices_needed is None and "6.00 GiB" in str(info.value)
    tiny = simple([1.0] * 3, p=1, static_bytes=(GiB,) * 3, devices=(DeviceSpec(memory=1),))
    with pytest.raises(PartitionMemoryError, match="no number of devices up to 3 fits"):
        partition(tiny, inflight_for=one_f_one_b)


def test_problem_validation_names_the_field():
    with pytest.raises(ValueError, match="cut_bytes has length 3; expected 4"):
        simple([1, 1, 1], p=1, cut_bytes=(0, 0, 0))
    with pytest.raises(ValueError, match="inflight has length 1; expected 2"):
        simple([1, 1, 1], p=2, inflight=(1,))
    with pytest.raises(ValueError, match="block_times must be finite and >= 0"):
        simple([1, -1, 1], p=1)
    with pytest.raises(ValueError, match="speed must be > 0"):
        DeviceSpec(speed=0.0)


# --- helpers ------------------------------------------------------------------------------------

def test_evaluate_and_its_validation():
    pr = simple([1, 2, 3, 4], p=2, static_bytes=(1, 1, 1, 1))
    got = evaluate(pr, [0, 3, 4])
    assert got.bounds == (0, 3, 4) and got.stage_times == (6.0, 4.0)
    assert got.stage_memory == (3.0, 1.0)
    for bad in [(0, 4), (0, 2, 2, 4), (1, 2, 4), (0, 2, 5), (0, 3, 2)]:
        with pytest.raises(ValueError, match="strictly increasing"):
            evaluate(pr, bad)


def test_uniform_bounds():
    assert uniform_bounds(10, 3) == (0, 4, 7, 10)
    assert uniform_bounds(6, 3) == (0, 2, 4, 6)
    assert uniform_bounds(5, 5) == (0, 1, 2, 3, 4, 5)
    assert uniform_bounds(7, 1) == (0, 7)


def test_lower_bound():
    devices = (DeviceSpec(speed=1.0), DeviceSpec(speed=3.0))
    assert lower_bound(simple([2, 2, 2, 2], p=2, devices=devices)) == 2.0  # 8 / (1 + 3)
    assert lower_bound(simple([1, 1, 9], p=2, devices=devices)) == 3.0  # 9 / 3


def test_balanced_by():
    assert balanced_by([1, 2, 3, 4, 5, 6], 3) == (0, 3, 5, 6)
    assert balanced_by([10, 1, 1, 1, 1, 10], 2) == (0, 3, 6)
    assert balanced_by([5], 1) == (0, 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        balanced_by([1, math.nan], 1)


def test_format_bytes():
    assert format_bytes(1.5 * GiB) == "1.50 GiB"
    assert format_bytes(12 * 2**20) == "12.00 MiB"
    assert format_bytes(GiB + 1) == "1.01 GiB"  # rounded up: never understates a requirement
    assert format_bytes(100) == "100 B"
    assert format_bytes(math.inf) == "inf"


def test_large_problem_is_feasible_and_no_single_cut_move_improves_it():
    rng = random.Random(7)
    n, p = 200, 16
    pr = PartitionProblem(
        block_times=tuple(rng.uniform(0.5, 2.0) for _ in range(n)),
        cut_bytes=(0.0, *(rng.uniform(0, 1e6) for _ in range(n - 1)), 0.0),
        static_bytes=tuple(rng.uniform(0, 1e8) for _ in range(n)),
        activation_bytes=tuple(rng.uniform(0, 1e7) for _ in range(n)),
        devices=tuple(DeviceSpec(speed=rng.uniform(0.5, 2), memory=4e9, bandwidth=1e9)
                      for _ in range(p)),
        inflight=one_f_one_b(p))
    got = partition(pr)
    assert got.num_stages == p and got.bottleneck >= lower_bound(pr)
    assert all(m <= d.memory for m, d in zip(got.stage_memory, pr.devices))
    assert evaluate(pr, got.bounds) == got
    # too large for brute force; an optimum is at least locally optimal: moving any one cut
    # by a block either breaks a memory limit or leaves the bottleneck no lower
    for i in range(1, p):
        for step in (-1, 1):
            moved = list(got.bounds)
            moved[i] += step
            if not moved[i - 1] < moved[i] < moved[i + 1]:
                continue
            other = evaluate(pr, moved)
            if all(m <= d.memory for m, d in zip(other.stage_memory, pr.devices)):
                assert other.bottleneck >= got.bottleneck * (1 - 1e-12), (i, step)
