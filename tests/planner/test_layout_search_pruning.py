"""The layout search with tensor_parallel="auto" explores less without choosing otherwise: the
layouts searched lowest bound first and pruned by it give the winner, the step and the plan
of the search that costs every layout, every layout is still listed (a pruned one saying
why), and each rank's share of the blocks is priced once per (granularity, micro-batch size,
T)."""

from __future__ import annotations

import math

import pytest
import torch

import pipecompile as pc
from pipecompile.outputs.report import explain_layouts
from pipecompile.planner import layout_passes, layout_search, schedule_search

# with -n, one worker runs this module (pyproject.toml: loadgroup): its fixtures run once
pytestmark = pytest.mark.xdist_group("search-layouts")

DEVICES = pc.cluster("h100", nodes=2, per_node=8)


def _llama():
    """A small transformers Llama on the meta device (nothing allocated), 8 heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=4, hidden_size=1024, intermediate_size=3584,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=4096,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty(16, 1024, dtype=torch.long, device="meta")
    return model, (ids,), {"labels": ids}


def _compile():
    model, args, kwargs = _llama()
    return pc.compile(model, args, kwargs, devices=DEVICES, data_parallel="auto",
                      fsdp="auto", tensor_parallel="auto",
                      optimizer=lambda p: torch.optim.AdamW(p))


@pytest.fixture(scope="module")
def searched():
    """(the pruned search, the search of every layout in `layouts`' order, the keys each
    rank's share was priced at)."""
    priced: list[tuple[int, int, int]] = []
    share = layout_passes.shard_costs

    def counted(costs, tensor, **kwargs):
        priced.append((id(costs), tensor.degree, kwargs["batch_size"]))
        return share(costs, tensor, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(layout_passes, "shard_costs", counted)
        pruned = _compile()
    with pytest.MonkeyPatch.context() as patch:  # no bounds: every layout searched, in order,
        patch.setattr(layout_search, "_floors", lambda layouts, bound: [0.0] * len(layouts))
        patch.setattr(schedule_search, "_limit", lambda above, found: math.inf)  # every plan
        every = _compile()
    return pruned, every, priced


def test_pruning_keeps_the_winner_its_plan_and_its_step(searched):
    pruned, every, _ = searched
    a, b = pruned.plan.search.layouts[0], every.plan.search.layouts[0]
    assert a.layout == b.layout
    assert (a.schedule, a.microbatches, a.virtual_stages, a.recomputed) == (
        b.schedule, b.microbatches, b.virtual_stages, b.recomputed)
    assert a.step == b.step and a.memory == b.memory
    assert pruned.plan.search.best == every.plan.search.best
    assert pruned.predicted.makespan == pytest.approx(every.predicted.makespan, rel=1e-12)
    assert {c.layout.tensor_parallel for c in every.plan.search.layouts} == {1, 2, 4, 8}


def test_every_layout_is_listed_and_a_pruned_one_says_why(searched):
    pruned, every, _ = searched
    listed = {c.layout: c for c in pruned.plan.search.layouts}
    assert set(listed) == {c.layout for c in every.plan.search.layouts}
    skipped = [c for c in listed.values() if "not searched" in c.reason]
    assert skipped, "the bound prunes some layout of this model"
    partly = [c for c in listed.values() if layout_search.PARTLY in c.reason]
    best = pruned.plan.search.layouts[0].step
    for c in every.plan.search.layouts:
        mine = listed[c.layout]
        if mine in skipped:  # pruned: its full search could not have won
            assert not c.fits or c.step > best * (1 + 1e-3)
            assert ("its compute alone takes" in mine.reason
                    or "not searched in full: its plans take at least" in mine.reason)
        elif mine in partly:  # plans bounded over the best not simulated: the best of the rest
            # (a near tie, within schedule_search.TIE, goes to the least memory: the full
            # search may keep a plan up to TIE slower that the partial one did not simulate)
            assert c.fits and mine.step * (1 + schedule_search.TIE) >= c.step
            assert c.step > best * (1 + 1e-3)
        else:  # searched: the same result as the search of every layout
            assert (mine.step == c.step) or (not mine.fits and not c.fits)
    assert not any(schedule_search.NOT_SIMULATED in x.reason
                   for x in every.plan.search.candidates)
    layouts = pruned.plan.search.layouts
    assert f"layouts compared: {len(every.plan.search.layouts)}" in pruned.explain()
    table = explain_layouts(layouts, top=len(layouts))
    assert table.count("not searched") == len(skipped)


def test_each_rank_share_is_priced_once(searched):
    _, _, priced = searched
    assert priced and len(priced) == len(set(priced))
    assert all(t > 1 for _, t, _ in priced)


def test_the_search_order_is_the_bounds_and_ties_keep_the_layouts_order():
    """Three layouts whose steps are known: the lowest bound is searched first and prunes the
    one whose bound is over the best; the two that tie go to the earlier in the list."""
    from pipecompile.planner.layout import Layout
    from pipecompile.planner.schedule_search import Candidate, SearchResult

    lays = [Layout(1, 4), Layout(2, 2), Layout(4, 1)]
    steps = {lays[0]: 1.0, lays[1]: 1.0004, lays[2]: 3.0}
    floors = {lays[0]: 0.9, lays[1]: 0.5, lays[2]: 2.0}
    ran: list = []

    def run(layout):
        ran.append(layout)
        c = Candidate("1f1b", 4, 1, step=steps[layout], memory=(1.0,))
        return SearchResult(c, (c,), 0.0, ())

    found, tried = layout_search.search_layouts(lays, run, bound=floors.__getitem__)
    assert ran == [lays[1], lays[0]]  # bound order; the third is over the best: not run
    assert tried[0].layout == lays[0] and found.best.step == 1.0  # the tie: the earlier
    assert [c.layout for c in tried] == [lays[0], lays[1], lays[2]]
    assert "not searched" in tried[2].reason and not math.isfinite(tried[2].step)
