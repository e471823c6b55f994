"""The compiler passes' declared contracts: what each requires, produces and updates."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from pipecompile.planner.recipe import PASSES
from pipecompile.planner.options import CompileOptions
from pipecompile.ir.devices import DeviceSpec
from pipecompile.planner.plan import Pass, PassContractError, Plan, check_contracts, run_passes


def _start() -> Plan:
    return Plan(CompileOptions(devices=(DeviceSpec(),), microbatches=2, schedule="gpipe"))


def test_the_compiler_passes_form_a_valid_order():
    produced = {"asked", "resolved"}  # compile starts both; the resolver's passes update one
    for p in PASSES:
        needed = set(p.requires) | set(p.updates)
        assert needed <= produced, (p.name, needed - produced)
        produced |= set(p.produces)
    check_contracts(PASSES)


def test_every_plan_field_has_exactly_one_producing_pass():
    producers: dict[str, list[str]] = {}
    for p in PASSES:
        for name in p.produces:
            producers.setdefault(name, []).append(p.name)
    settable = {f.name for f in fields(Plan)} - {"asked", "resolved", "request", "passes",
                                                 "produced"}
    assert {name: len(by) for name, by in producers.items()} == dict.fromkeys(settable, 1)


def test_a_missing_requirement_names_the_pass_the_field_and_its_producer():
    skipped = Pass("costing", lambda plan, example: None, produces=("cores",))
    reader = Pass("reader", lambda plan, example: (plan, "read"), requires=("cores",))
    with pytest.raises(PassContractError, match=r"'reader' requires plan\.cores, which the "
                                                r"'costing' pass produces, but it has not run"):
        run_passes(_start(), (skipped, reader), example=None)


def test_a_requirement_produced_only_later_is_refused_before_anything_runs():
    ran = []
    reader = Pass("reader", lambda plan, example: ran.append(1) or (plan, ""),
                  requires=("cores",))
    later = Pass("later", lambda plan, example: (replace(plan, cores=2), ""),
                 produces=("cores",))
    with pytest.raises(PassContractError, match="'reader' requires plan.cores, which the "
                                                "'later' pass produces after it"):
        run_passes(_start(), (reader, later), example=None)
    assert ran == []


def test_a_pass_that_does_not_produce_its_output_raises():
    lazy = Pass("lazy", lambda plan, example: (plan, "did nothing"), produces=("linear",))
    with pytest.raises(PassContractError, match="'lazy' declares it produces plan.linear but "
                                                "left it None"):
        run_passes(_start(), (lazy,), example=None)


def test_a_pass_may_not_fill_in_a_field_it_does_not_declare():
    """The old pre-filling (`plan.linear or ...`): a pass setting another pass's output."""
    eager = Pass("eager", lambda plan, example: (replace(plan, cores=2, efficiency=0.5), ""),
                 produces=("cores",))
    with pytest.raises(PassContractError, match="'eager' changed plan.efficiency"):
        run_passes(_start(), (eager,), example=None)


def test_two_producers_of_one_field_are_refused():
    one = Pass("one", lambda plan, example: (replace(plan, cores=1), ""), produces=("cores",))
    two = Pass("two", lambda plan, example: (replace(plan, cores=2), ""), produces=("cores",))
    with pytest.raises(PassContractError, match="produced by both the 'one' and the 'two'"):
        check_contracts((one, two))


def test_a_pass_that_rewrites_what_was_asked_is_refused():
    rewriter = Pass("rewriter", lambda plan, example: (
        replace(plan, asked=replace(plan.asked, microbatches=4)), ""), updates=("resolved",))
    with pytest.raises(PassContractError, match="'rewriter' rewrote what was asked"):
        run_passes(_start(), (rewriter,), example=None)
    resolver = Pass("resolver", lambda plan, example: (
        replace(plan, resolved=replace(plan.resolved, microbatches=4)), "4"),
        updates=("resolved",))
    plan = run_passes(_start(), (resolver,), example=None)
    assert (plan.asked.microbatches, plan.resolved.microbatches) == (2, 4)


def test_an_update_needs_the_field_produced_first_and_may_then_change_it():
    first = Pass("first", lambda plan, example: (replace(plan, cores=1), ""), produces=("cores",))
    again = Pass("again", lambda plan, example: (replace(plan, cores=4), ""), updates=("cores",))
    assert run_passes(_start(), (first, again), example=None).cores == 4
    with pytest.raises(PassContractError, match="'again' requires plan.cores"):
        check_contracts((again, first))


def test_ready_reads_a_field_with_its_type_and_raises_when_it_is_missing():
    plan = _start()
    with pytest.raises(PassContractError, match=r"plan\.linear is read before a pass produced it"):
        plan.ready.linear
    with pytest.raises(PassContractError, match="not a field"):
        check_contracts((Pass("typo", lambda plan, example: None, requires=("lineer",)),))
