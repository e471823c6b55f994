"""resolved.py: the `Resolved` record holds only what the join, search and ranks passes resolve;
`resolve` applies the search's choices; `merged_options` is the deprecated single view."""

from __future__ import annotations

from dataclasses import fields

from pipecompile.ir.devices import DeviceSpec
from pipecompile.planner.layout import Layout
from pipecompile.planner.options import CompileOptions
from pipecompile.planner.resolved import Choices, Resolved, merged_options, resolve

ASKED = CompileOptions(devices=(DeviceSpec("cpu"), DeviceSpec("cpu")), microbatches=2,
                       schedule="gpipe", split_points=("layers.1",), rng="per-microbatch",
                       auto=frozenset({"schedule", "microbatches", "checkpoint"}))


def test_resolved_holds_only_what_the_passes_resolve():
    names = [f.name for f in fields(Resolved)]
    assert names == ["devices", "ranks", "data_parallel", "tensor_parallel", "sequence_parallel",
                     "fsdp", "schedule", "given_schedule", "microbatches", "virtual_stages",
                     "checkpoint", "profile"]
    assert (len(names), len(fields(CompileOptions))) == (12, 30)
    never_resolved = {"loss_fn", "optimizer", "split_points", "capture", "rng", "timeout",
                      "auto", "cache", "cluster", "global_batch", "mesh"}
    assert never_resolved.isdisjoint(names)


def test_start_is_the_asked_starting_values():
    start = Resolved.start(ASKED)
    assert (start.devices, start.schedule, start.microbatches, start.checkpoint) == (
        ASKED.devices, "gpipe", 2, False)
    assert (start.num_stages, start.stage_checkpoint(1), start.topology) == (2, False, None)
    assert not start.asynchronous and not start.split_backward


def test_resolve_applies_the_choices_and_a_searched_layout():
    start = Resolved.start(ASKED)
    chosen = resolve(start, Choices("zb-h1", 4, 1, (True, False)))
    assert (chosen.schedule, chosen.microbatches, chosen.checkpoint) == (
        "zb-h1", 4, (True, False))
    assert chosen.split_backward and [chosen.stage_checkpoint(s) for s in (0, 1)] == [
        True, False]
    assert chosen.devices == start.devices and start.schedule == "gpipe"  # input unchanged
    one = (DeviceSpec("cpu", bandwidth=1e9),)
    laid = resolve(start, Choices("1f1b", 2, 1, (False,), layout=Layout(1, 2, True),
                                  devices=one))
    assert (laid.devices, laid.data_parallel, laid.fsdp, laid.num_stages) == (one, 2, True, 1)


def test_merged_options_is_the_asked_record_with_the_resolved_values():
    chosen = resolve(Resolved.start(ASKED), Choices("1f1b", 4, 1, (False, True)))
    merged = merged_options(ASKED, chosen)
    assert (merged.schedule, merged.microbatches, merged.checkpoint) == (
        "1f1b", 4, (False, True))
    assert (merged.split_points, merged.rng, merged.auto) == (
        ("layers.1",), "per-microbatch", ASKED.auto)
