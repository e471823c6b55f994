"""ir/shard_plan.py: the records of a tensor-parallel split say what was split and why the
rest stayed whole."""

from __future__ import annotations

from pipecompile.ir.shard_plan import Placement, ShardPlan


def test_a_plan_summarises_its_pairs_and_what_stayed_replicated():
    fused = Placement(dim=0, parts=(8, 8, 8), role="column")
    row = Placement(dim=1, parts=(8,), role="row")
    plan = ShardPlan(2, {"qkv.weight": fused, "proj.weight": row}, columns=("addmm",),
                     rows=("addmm_1",), notes=("lm_head: reaches a graph output",))
    assert repr(fused) == "Placement(column, dim=0, parts=[8, 8, 8])"
    assert repr(row) == "Placement(row, dim=1)"
    assert plan.summary() == ("1 column- and 1 row-parallel matmuls, 2 parameters split over 2; "
                              "replicated: lm_head: reaches a graph output")
    assert ShardPlan(4, {}).summary() == "nothing to shard at T=4: every parameter replicated"


def test_a_plan_names_its_vocabulary_choices():
    table = Placement(dim=0, parts=(64,), role="vocabulary")
    plan = ShardPlan(2, {"lm_head.weight": table}, embeddings=("embedding",),
                     outputs=("linear",), vocabulary=("lm_head.weight split over 2",))
    assert repr(table) == "Placement(vocabulary, dim=0)"
    assert plan.summary() == ("0 column- and 0 row-parallel matmuls, 1 parameters split over 2; "
                              "vocabulary: lm_head.weight split over 2")
    assert ShardPlan(2, {}, vocabulary=("wpe.weight replicated",)).summary() == (
        "nothing to shard at T=2: every parameter replicated; vocabulary: wpe.weight replicated")


def test_a_plan_round_trips_through_json():
    import json

    plan = ShardPlan(2, {"qkv.weight": Placement(0, (8, 8, 8), "column"),
                         "proj.weight": Placement(1, (8,), "row")},
                     columns=("addmm",), rows=("addmm_1",), split={"view": 2, "addmm": 1},
                     notes=("lm_head: reaches a graph output",))
    assert ShardPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
