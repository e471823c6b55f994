"""What the runtime computes once instead of on every step or action (bench/overhead.py):
micro-batch sizes without allocating, saved-activation counts reused per layout, receive
shapes evaluated once per distinct sizes. Each must give exactly what recomputing gives."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.runtime.memory import SavedActivations
from pipecompile.runtime.microbatch import _chunk_sizes
from pipecompile.runtime.p2p import P2PTransport, ValueSpec, Waiter


def test_chunk_sizes_are_torch_chunks() -> None:
    for batch in range(1, 40):
        for num in range(1, batch + 1):
            expected = [c.shape[0] for c in torch.arange(batch).chunk(num)]
            assert _chunk_sizes(batch, num) == expected, (batch, num)


def _pipe(devices: int) -> tuple[pc.Pipeline, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return pc.compile(model, (x,), devices=devices, microbatches=4, loss_fn=F.mse_loss), x, y


def test_saved_activation_counts_reused_are_the_counted_ones() -> None:
    pipe, x, y = _pipe(2)
    pipe.step(x, target=y)
    workers = pipe.runtime.workers
    first = {s: dict(w.activations.microbatch) for s, w in workers.items()}
    peaks = {s: w.activations.peak for s, w in workers.items()}
    assert all(v > 0 for counts in first.values() for v in counts.values())
    pipe.step(x, target=y)  # every forward now has a known layout: no hook runs
    for s, w in workers.items():
        assert len(w.activations.counted) == 1  # the 4 micro-batches share one layout
        assert dict(w.activations.microbatch) == first[s]
        assert w.activations.peak == peaks[s]


def test_record_counts_a_new_layout_and_reuses_a_known_one() -> None:
    lin = nn.Linear(4, 4)
    acts = SavedActivations()
    for mb, layout in enumerate(["a", "a", None]):
        with acts.record(mb, frozenset(), layout):
            torch.tanh(lin(torch.randn(3, 4))).sum()
    assert acts.counted == {"a": acts.held[0]}
    assert acts.held[0] == acts.held[1] == acts.held[2] > 0


def test_receive_shapes_are_evaluated_once_per_sizes() -> None:
    calls = []

    def shape(sizes):
        calls.append(dict(sizes))
        return (sizes["b"], 3)

    cache: dict = {}
    sizes = [{"b": 2}, {"b": 2}, {"b": 1}]
    for _ in range(2):  # two steps sharing the runtime's cache
        transport = P2PTransport(rank=0, rank_of_stage=lambda s: s,
                                 specs={"h": ValueSpec(shape, torch.float32)},
                                 devices=(torch.device("cpu"),) * 2, sizes=sizes, timeout=5.0,
                                 waiter=Waiter(), shapes=cache)
        assert [transport._shape("h", mb) for mb in range(3)] == [(2, 3), (2, 3), (1, 3)]
    assert calls == [{"b": 2}, {"b": 1}]


def test_layouts_kept_are_bounded() -> None:
    acts = SavedActivations()
    lin = nn.Linear(2, 2)
    for mb in range(70):  # e.g. a scalar input that differs on every step
        with acts.record(mb, frozenset(), ("scalar", float(mb))):
            lin(torch.randn(1, 2)).sum()
    assert len(acts.counted) == 64
    assert all(acts.held[mb] == acts.held[0] > 0 for mb in range(70))
