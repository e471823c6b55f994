"""The compile cache: bounded, least recently used out first, keyed by content, and explicit
(what compile returns depends on the cache it is given, not on what the process did before)."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
import pipecompile.measure.probe as probe_module
from pipecompile.ir.compile_cache import CompileCache, function_key, layout


def test_the_cache_never_holds_more_than_its_bound_and_drops_the_least_recently_used():
    cache = CompileCache(maxsize=3)
    computed = []

    def get(key):
        return cache.get(key, lambda: computed.append(key) or key * 10)

    for key in range(10):
        assert get(key) == key * 10
        assert len(cache) <= 3
    assert computed == list(range(10)) and len(cache) == 3
    assert get(8) == 80 and computed[-1] == 9  # held: not computed again
    get(10)  # full: 7 was used least recently (8 was just read)
    assert 7 not in cache and 8 in cache and 9 in cache
    assert (cache.hits, cache.misses) == (1, 11)
    cache.clear()
    assert len(cache) == 0
    with pytest.raises(ValueError, match="maxsize"):
        CompileCache(maxsize=0)


def test_keys_are_content_not_identity():
    def make():
        return lambda out, y: (out - y).pow(2).mean()

    assert function_key(make()) == function_key(make())  # two objects, one code
    assert function_key(lambda out, y: (out - y).abs().mean()) != function_key(make())
    assert function_key(None) is None
    assert layout((torch.zeros(2, 3), 1)) == (((2, 3), "torch.float32"), "int")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 8))


def _compile(cache: CompileCache) -> pc.Pipeline:
    """Micro-batches searched: the planning probe runs (its times decide them)."""
    return pc.compile(_model(), (torch.randn(8, 8),), devices=2, schedule="gpipe",
                      loss_fn=lambda out, y: (out - y).pow(2).mean(), cache=cache)


def test_compiles_with_one_cache_reuse_the_probe_and_another_cache_measures_again(monkeypatch):
    measured = []
    real = probe_module._probe
    monkeypatch.setattr(probe_module, "_probe",
                        lambda *args, **kwargs: measured.append(1) or real(*args, **kwargs))
    shared = CompileCache(maxsize=8)
    first = _compile(shared)
    assert len(measured) == 1 and "measured: block times" in first.explain()
    second = _compile(shared)  # a new model instance and loss function: equal content
    assert len(measured) == 1
    assert second.plan.probe == first.plan.probe
    assert len(shared) <= 8
    _compile(CompileCache())  # another cache: nothing carried over
    assert len(measured) == 2
    shared.clear()
    _compile(shared)
    assert len(measured) == 3
