"""compile with data_parallel="auto" on a cluster of absent devices: the layout is a choice
of the plan, priced with its collectives; the options that refuse a layout say why."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError
from pipecompile.ir.formats import format_bytes
from pipecompile.planner import layout_options, layout_passes, throughput
from pipecompile.planner.layout import Layout, layout_static
from pipecompile.schedule.actions import Schedule

# with -n, one worker runs this module (pyproject.toml: loadgroup): its fixture runs once
pytestmark = pytest.mark.xdist_group("search-layouts")

DEVICES = pc.cluster("h100", nodes=2, per_node=2)


def _gpt():
    torch.manual_seed(0)
    return zoo.GPT(vocab=64, dim=64, layers=4, heads=4, seq=64), torch.randint(0, 64, (8, 64))


@pytest.fixture(scope="module")
def auto():
    model, ids = _gpt()
    return pc.compile(model, (ids,), devices=DEVICES, data_parallel="auto", fsdp="auto",
                      optimizer=lambda p: torch.optim.AdamW(p))


def test_the_search_chooses_a_layout_and_predicts_the_whole_job(auto):
    layout = auto.layout
    assert layout.pipeline * layout.data_parallel == 4 and layout.pipeline_rank is None
    assert layout_passes.layout_search_pass is not None
    tried = auto.plan.search.layouts
    assert tried[0].layout == layout and len(tried) >= 4
    assert all(c.step >= tried[0].step for c in tried if c.fits)
    # the compiled plan predicts the step the search predicted, collectives included
    assert auto.predicted.makespan == pytest.approx(tried[0].step, rel=1e-9)
    assert len(auto.plan.resolved.devices) == layout.pipeline
    assert auto.plan.resolved.data_parallel == layout.data_parallel
    text, explained = str(auto), auto.explain()
    assert f"layout {layout}" in text and "tokens/s per device" in text and "MFU" in text
    assert "layouts compared" in explained and "chosen" in explained


def test_throughput_counts_the_global_batch_and_the_peak(auto):
    rate = throughput.throughput(auto.plan)
    assert rate is not None and rate.samples == 8 and rate.tokens == 8 * 64
    assert rate.devices == 4 and rate.peak == pytest.approx(66.9e12)  # float32 model
    forward = sum(b.forward_flops for b in auto.plan.costs.blocks)
    per_microbatch = 8 // (auto.plan.resolved.microbatches * auto.layout.data_parallel)
    assert rate.model_flops == pytest.approx(3 * forward * 8 / per_microbatch)
    assert rate.mfu == pytest.approx(rate.model_flops / (rate.step * 4 * 66.9e12))


def test_a_given_data_parallel_degree_and_a_written_schedule_fix_the_layout():
    model, ids = _gpt()
    forced = pc.compile(model, (ids,), devices=DEVICES, data_parallel=2, fsdp=False)
    assert (forced.layout.pipeline, forced.layout.data_parallel) == (2, 2)
    assert not forced.layout.fsdp
    written = Schedule.from_text("name: mine\n0: 0F0 0F1 0B0 0B1\n1: 1F0 1B0 1F1 1B1")
    fixed = pc.compile(model, (ids,), devices=DEVICES, data_parallel="auto", schedule=written)
    assert fixed.layout.pipeline == 2 and fixed.plan.resolved.microbatches == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(data_parallel=3), "data_parallel=3 does not divide the 4 devices"),
    (dict(data_parallel=16, devices=pc.cluster("a100", nodes=2, per_node=8)),
     "fewer than data_parallel=16 replicas"),
    (dict(data_parallel="auto", fsdp="sometimes"), "fsdp must be True, False or 'auto'"),
    (dict(data_parallel="auto", devices=4), "layout of devices that are not here"),
    (dict(data_parallel="auto", schedule="pipedream"), "cannot be data-parallel"),
])
def test_bad_layout_options_say_what_to_pass(kwargs, message):
    model, ids = _gpt()
    options = {"devices": DEVICES, **kwargs}
    with pytest.raises(ConfigError, match=message):
        pc.compile(model, (ids,), **options)
    assert layout_options.layout_options(4, 1, False, None) is None


def test_a_world_no_layout_divides_is_refused():
    model = torch.nn.Linear(4, 4)  # one block: P = 1 only, and D = 2 does not divide 1 sample
    with pytest.raises(ConfigError, match="no layout of 2 devices fits"):
        pc.compile(model, (torch.randn(1, 4),), devices=pc.cluster("h100", per_node=2),
                   data_parallel="auto")
    assert Layout(1, 5).devices == 5


def test_a_given_degree_that_does_not_share_the_batch_is_refused():
    model, _ = _gpt()
    ids = torch.randint(0, 64, (6, 64))  # 6 samples: 4 replicas cannot share them
    with pytest.raises(ConfigError, match="data_parallel=4 replicas cannot share the global"):
        pc.compile(model, (ids,), devices=DEVICES, data_parallel=4)


def test_a_layout_whose_state_cannot_fit_is_refused_before_its_search():
    model, ids = _gpt()
    n = sum(p.numel() for p in model.parameters())
    # float32 AdamW: 16 n bytes replicated, 8 n + 12 n / 4 FSDP over 4; a device holds 9 n
    pipe = pc.compile(model, (ids,), devices=DEVICES, data_parallel="auto", fsdp="auto",
                      memory_limit=9 * n, optimizer=lambda p: torch.optim.AdamW(p))
    tried = {c.layout: c for c in pipe.plan.search.layouts}
    one = [c for lay, c in tried.items() if lay.pipeline == 1]
    assert len(one) == 2 and all("does not fit: needs at least" in c.reason for c in one)
    held = [(c.param_bytes, c.grad_bytes, c.optimizer_bytes) for c in pipe.plan.costs.symbolic]
    replicated = sum(b.static_bytes for b in pipe.plan.costs.blocks)  # 16 n and the buffers
    sharded = sum(layout_static(*h, Layout(1, 4, fsdp=True)) for h in held)
    assert 16 * n <= replicated < 16.5 * n and 11 * n <= sharded < 11.5 * n
    assert {c.reason.split("at least ")[1].split(" on")[0] for c in one} == {
        format_bytes(replicated), format_bytes(sharded)}
    assert pipe.layout.pipeline >= 2 and tried[pipe.layout].fits
