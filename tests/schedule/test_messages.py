"""The message IR: links from a program's wiring, who produces what, and each message's bytes."""

from __future__ import annotations

from pipecompile.schedule.messages import Dataflow, Link, link_bytes

# a U-Net-like wiring: "e1" skips from stage 0 to stage 2, "n" is an integer (no gradient)
FLOW = Dataflow.from_wiring({"e1": 0, "h": 0, "n": 0, "g": 1},
                            {"e1": (1, 2), "h": (1,), "n": (2,), "g": (2,)},
                            grad_values={"e1", "h", "g"}, num_stages=3)


def test_links_group_the_values_each_stage_reads_from_another():
    assert FLOW.links == (Link(0, 1, ("e1", "h"), ("e1", "h")), Link(0, 2, ("e1", "n"), ("e1",)),
                          Link(1, 2, ("g",), ("g",)))
    assert FLOW.producers() == {"e1": 0, "h": 0, "n": 0, "g": 1}


def test_link_bytes_sum_the_values_forward_and_the_gradients_back():
    size = {"e1": 100, "h": 10, "n": 8, "g": 1}.__getitem__
    assert link_bytes(FLOW, size) == {(0, 1, "F"): 110, (1, 0, "B"): 110, (0, 2, "F"): 108,
                                      (2, 0, "B"): 100, (1, 2, "F"): 1, (2, 1, "B"): 1}
