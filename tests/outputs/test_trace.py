"""One chrome trace for the job: every device's actions and a flow from each send to its
receive; under torchrun (2 gloo ranks) rank 0 writes both ranks' actions, a pid per rank, and
every rank profiles its actions as PP: ranges and gets the job's metrics."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import pipecompile as pc
from pipecompile.outputs.trace import chrome_trace
from pipecompile.schedule.actions import Action, Kind
from tests.distributed.ranks import run_ranks
from tests.distributed.observe_cases import observed_step


def _flows(trace):
    """{flow id: (start event, finish event)}."""
    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    ends = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert starts.keys() == ends.keys()
    return {k: (starts[k], ends[k]) for k in starts}


def _check_flows(trace, schedule, rank_of_device):
    sends = [a for row in schedule.actions for a in row if a.kind in (Kind.SEND_F, Kind.SEND_B)]
    flows = _flows(trace)
    assert len(flows) == len(sends) > 0
    for start, end in flows.values():
        send, recv = (Action.parse(t) for t in start["name"].split(" -> "))
        assert recv.kind.value == send.kind.value.replace("SEND", "RECV")
        assert (recv.stage, recv.peer, recv.microbatch) == (send.peer, send.stage,
                                                             send.microbatch)
        home = schedule.stage_to_device
        assert (start["pid"], start["tid"]) == (rank_of_device(home[send.stage]),
                                                home[send.stage])
        assert (end["pid"], end["tid"]) == (rank_of_device(home[recv.stage]), home[recv.stage])
        assert end["bp"] == "e"


def test_one_process_trace_has_every_device_and_a_flow_per_message(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    x = torch.randn(8, 8)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=torch.nn.functional.mse_loss)
    pipe.step(x, target=x)
    trace = json.load(open(pipe.write_chrome_trace(str(tmp_path / "t.json"))))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [str(e.action) for e in pipe.timeline().events]
    assert {(e["pid"], e["tid"]) for e in spans} == {(0, 0), (0, 1)}
    assert min(e["ts"] for e in spans) == 0.0
    _check_flows(trace, pipe.schedule, lambda device: 0)


def test_offsets_move_each_rank_onto_rank_zeros_clock():
    rows = [[(0, "0F0", 10.0, 11.0), (0, "0SEND_F0>1", 11.0, 11.5)],
            [(1, "1RECV_F0<0", 110.5, 112.0), (1, "1F0", 112.0, 113.0)]]
    trace = chrome_trace(rows, offsets=[0.0, 100.0])
    spans = {e["name"]: (e["pid"], e["ts"], e["dur"]) for e in trace["traceEvents"]
             if e["ph"] == "X"}
    assert spans == {"0F0": (0, 0.0, 1e6), "0SEND_F0>1": (0, 1e6, 0.5e6),
                     "1RECV_F0<0": (1, 0.5e6, 1.5e6), "1F0": (1, 2e6, 1e6)}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    (flow,) = _flows(trace).values()
    assert flow[0]["ts"] == 1.25e6 and flow[1]["ts"] == 1.25e6


def test_two_ranks_profile_their_actions_and_rank_zero_writes_the_job_trace(tmp_path):
    results = run_ranks(observed_step, 2, str(tmp_path / "job.json"))
    for r in results:
        assert "error" not in r and "died" not in r, r
    # the profiler: one range per action of each rank's row, the forward's addmm under its F
    for rank, r in enumerate(results):
        assert r["ranges"] == {f"PP:{a}": 1 for a in r["row"]}
        # (a backward's addmm, if any, sits under B; none runs outside a range)
        assert {f"PP:{rank}F{i}" for i in range(4)} <= set(r["forward_ops"])
        assert None not in r["forward_ops"]
    # metrics: the same dict on both ranks, the job's bubble from both devices' compute
    a, b = results[0]["metrics"], results[1]["metrics"]
    assert a == b
    assert a["loss"] == pytest.approx(results[1]["loss"], rel=1e-6)
    span = max(r["span"] for r in results)
    assert a["step_time_s"] == pytest.approx(span, rel=1e-12)
    busy = sum(r["busy"] for r in results)
    assert a["bubble_fraction"] == pytest.approx(1 - busy / (2 * span), rel=1e-9)
    assert a["samples_per_s"] == pytest.approx(8 / span, rel=1e-9)
    assert a["bytes_sent"] == 2 * 4 * 2 * 8 * 16 * 4  # F and B, 4 micro-batches of (2, 8, 16)
    # the trace: both ranks' actions, a pid each, a flow per message across the ranks
    trace = results[0]["trace"]
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank, r in enumerate(results):
        assert Counter(e["name"] for e in spans if e["pid"] == rank) == Counter(r["row"])
        assert {e["tid"] for e in spans if e["pid"] == rank} == {rank}
    schedule = pc.schedule.schedules.make_schedule("1f1b", 2, 4)
    rows = [[Action.parse(t) for t in r["row"]] for r in results]
    _check_flows(trace, _Rows(rows, schedule.stage_to_device), lambda device: device)


class _Rows:
    """The two ranks' rows as a schedule (actions per device, the stages' devices)."""

    def __init__(self, actions, stage_to_device):
        self.actions, self.stage_to_device = actions, stage_to_device
