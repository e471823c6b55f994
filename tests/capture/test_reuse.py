"""A capture reused for a structurally identical model (capture/reuse.py, keyed by
capture/fingerprint.py): the same graph over the new model's own tensors, so compiling with a
cache that keeps captures gives bit-equal losses and gradients; anything that changes the graph
(a float attribute, a config value, train/eval mode, the inputs) gives another key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipecompile as pc
from pipecompile.capture.capture import capture
from pipecompile.capture.fingerprint import model_key
from pipecompile.capture.reuse import rebind, rebindable
from pipecompile.ir.compile_cache import CompileCache
from tests.support import models


def _graph_step(captured, case) -> tuple[torch.Tensor, dict, dict]:
    """One forward and backward through the captured graph: loss, gradients, buffers."""
    from torch.utils import _pytree as pytree

    flat = captured.module(*captured.flatten_inputs(case.args, case.kwargs))
    loss = case.loss_fn(pytree.tree_unflatten(list(flat), captured.out_spec), case.target)
    loss.backward()
    return (loss.detach(), {n: p.grad for n, p in case.model.named_parameters()},
            {n: b.clone() for n, b in case.model.named_buffers()})


def _seeded(name: str):
    torch.manual_seed(0)
    return getattr(models, name)()


@pytest.mark.parametrize("name", ["gpt", "llama", "gpt2", "residual_cnn"])
def test_a_reused_capture_gives_bit_equal_loss_and_gradients(name):
    """GPT, transformers' Llama (buffers: rotary frequencies) and GPT-2 (tied embedding), a
    CNN with BatchNorm (running statistics written in place): a second, identical model gets
    the first's graph (one hit), and its loss, gradients and buffers after a step through it
    equal the first model's through its own fresh capture, bit for bit."""
    cache = CompileCache(captures=1)
    first, second = _seeded(name), _seeded(name)
    fresh = capture(first.model, first.args, first.kwargs, cache=cache)
    reused = capture(second.model, second.args, second.kwargs, cache=cache)
    assert cache.capture_hits == 1 and reused.module.code == fresh.module.code
    want, got = _graph_step(fresh, first), _graph_step(reused, second)
    assert torch.equal(got[0], want[0])
    for mine, theirs in zip(got[1:], want[1:]):
        assert mine.keys() == theirs.keys()
        for n, t in theirs.items():
            assert torch.equal(mine[n], t), n


def test_compile_with_a_cache_keeping_captures_steps_bit_equal():
    """Through compile (2 stages, 1F1B): the second compile reuses the capture and its step
    equals the first's bit for bit. The model holds no parameter used by two stages: on one
    device such a parameter is one object, whose gradient the two stages' threads accumulate
    in whichever order they reach it, 1e-17 apart from run to run with or without reuse
    (KeywordTupleModel's `encode.weight`, used at both ends, differed in 5 of 30 runs)."""
    cache = CompileCache(captures=1)
    steps = []
    for _ in range(2):
        case = _seeded("residual_cnn")
        pipe = pc.compile(case.model, case.args, case.kwargs, devices=2, microbatches=2,
                          loss_fn=case.loss_fn, schedule="1f1b", cache=cache)
        loss = pipe.step(*case.args, target=case.target, **case.kwargs).item()
        steps.append((loss, {n: p.grad.clone() for n, p in pipe.named_parameters()}))
    assert cache.capture_hits == 1
    assert steps[0][0] == steps[1][0] and steps[0][1].keys() == steps[1][1].keys()
    for n, g in steps[0][1].items():
        assert torch.equal(steps[1][1][n], g), n


def test_the_rebound_graph_holds_the_new_models_tensors_ties_included():
    """GPT-2's tied embedding: the rebound graph's parameters and buffers are the second
    model's own objects, under the names and in the order of its own capture."""
    first, second = models.gpt2(), models.gpt2()
    cache = CompileCache(captures=1)
    capture(first.model, first.args, cache=cache)
    reused = capture(second.model, second.args, cache=cache)
    own = capture(second.model, second.args)
    assert cache.capture_hits == 1
    assert reused.module.code == own.module.code
    mine = dict(second.model.named_parameters(remove_duplicate=False))
    got = list(reused.module.named_parameters(remove_duplicate=False))
    assert [n for n, _ in got] == [n for n, _ in own.module.named_parameters(remove_duplicate=False)]
    assert all(p is mine[n] for n, p in got)
    assert reused.module.get_parameter("lm_head.weight") is \
        reused.module.get_parameter("transformer.wte.weight")
    assert list(reused.module.state_dict()) == list(own.module.state_dict())
    assert reused.parameter_names == own.parameter_names
    assert reused.state_keys == own.state_keys


class Scaled(torch.nn.Module):
    def __init__(self, scale: float = 0.5, flag: bool = True) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale, self.flag = scale, flag

    def forward(self, x):
        y = self.linear(x) * self.scale
        return y.relu() if self.flag else y


def _key(model, x=None):
    return model_key(model, (torch.ones(2, 4) if x is None else x,), {}, ())


def test_a_float_attribute_a_flag_or_the_mode_gives_another_key():
    assert _key(Scaled()) == _key(Scaled())
    assert _key(Scaled(scale=0.5)) != _key(Scaled(scale=0.25))
    assert _key(Scaled(scale=0.0)) != _key(Scaled(scale=-0.0))
    assert _key(Scaled(flag=True)) != _key(Scaled(flag=False))
    assert _key(Scaled()) != _key(Scaled().eval())
    assert _key(Scaled()) != _key(Scaled().double(), torch.ones(2, 4, dtype=torch.float64))
    assert _key(Scaled()) != _key(Scaled(), torch.ones(3, 4))  # the example's shape
    frozen = Scaled()
    frozen.linear.bias.requires_grad_(False)
    assert _key(Scaled()) != _key(frozen)
    grad_on = _key(Scaled())
    with torch.no_grad():
        assert grad_on != _key(Scaled())
    assert model_key(Scaled(), (torch.ones(2, 4),), {}, ("export",)) != \
        model_key(Scaled(), (torch.ones(2, 4),), {}, ("fx",))  # capture's options


def test_a_config_value_gives_another_key_and_its_own_graph():
    """Two Llamas differing only in rms_norm_eps: different keys, and with one cache each
    compiles its own graph (the eps baked into the graph differs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama(eps: float) -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=32, vocab_size=64, max_position_embeddings=16, use_cache=False,
            rms_norm_eps=eps))

    ids = torch.randint(0, 64, (2, 8))
    assert _key(llama(1e-6), ids) == _key(llama(1e-6), ids)
    assert _key(llama(1e-6), ids) != _key(llama(1e-2), ids)
    cache = CompileCache(captures=4)
    a, b = llama(1e-6), llama(1e-2)
    graph_a = capture(a, (ids,), cache=cache)
    graph_b = capture(b, (ids,), cache=cache)
    assert cache.capture_hits == 0
    out_a = graph_a.module(*graph_a.flatten_inputs((ids,), {}))
    out_b = graph_b.module(*graph_b.flatten_inputs((ids,), {}))
    assert torch.equal(out_a[0], a(ids).logits) and torch.equal(out_b[0], b(ids).logits)
    assert not torch.equal(out_a[0], out_b[0])


def test_what_the_key_cannot_see_is_never_reused():
    hooked = Scaled()
    hooked.linear.register_forward_hook(lambda m, i, o: o * 2)
    assert _key(hooked) is None
    held = Scaled()
    held.extra = object.__new__(type("Slotted", (), {"__slots__": ("a",)}))
    assert _key(held) is None
    closure_value = [1.0]
    fn = Scaled()
    fn.act = lambda y: y * closure_value[0]
    before = _key(fn)
    assert before is not None and before == _key(fn)  # a closure over plain values: by value
    closure_value[0] = 2.0
    assert _key(fn) != before


class Constant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) + torch.tensor([1.0, 2.0, 3.0, 4.0])  # a constant made here


def test_a_graph_with_a_constant_made_in_forward_is_not_kept():
    x = (torch.ones(2, 4),)
    assert rebindable(capture(Constant(), x), Constant()) is None
    cache = CompileCache(captures=2)
    capture(Constant(), x, cache=cache)
    capture(Constant(), x, cache=cache)
    assert cache.capture_hits == 0 and "0/2 captures" in repr(cache)


def test_the_cache_is_bounded_and_keeps_no_tensor_data():
    cache = CompileCache(captures=1)
    x = (torch.ones(2, 4),)
    capture(Scaled(scale=1.0), x, cache=cache)
    capture(Scaled(scale=2.0), x, cache=cache)  # the first goes
    assert "1/1 captures" in repr(cache)
    capture(Scaled(scale=1.0), x, cache=cache)
    assert cache.capture_hits == 0
    source = Scaled()
    template = rebindable(capture(source, x), source)
    assert template is not None
    tensors = [*template.captured.module.parameters(), *template.captured.module.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    model = Scaled()
    rebound = rebind(template, model)
    assert rebound.module.get_parameter("linear.weight") is model.linear.weight
    assert torch.equal(rebound.module(x[0])[0], model(x[0]))
    cache.clear()
    assert "0/1 captures" in repr(cache)
    with pytest.raises(ValueError):
        CompileCache(captures=-1)


def test_the_default_cache_keeps_no_captures():
    # the library's default keeps none (the suite raises it: tests/conftest.py)
    from pipecompile.ir import compile_cache

    assert "default_cache = CompileCache()" in Path(compile_cache.__file__).read_text()
    assert CompileCache().captures == 0
    cache = CompileCache()
    capture(Scaled(), (torch.ones(2, 4),), cache=cache)
    capture(Scaled(), (torch.ones(2, 4),), cache=cache)
    assert cache.capture_hits == 0 and "0/0 captures" in repr(cache)


def test_a_meta_model_traced_claiming_the_cpu_reuses_the_capture_of_an_identical_one():
    """Two Llamas built on the meta device, captured on fakes claiming the CPU (as compile does
    for a meta model it will run on the CPU): the second gets the first's graph over its own
    meta tensors, the traced device kept; a real Llama of the same shapes keys apart."""
    cache = CompileCache(captures=2)
    with torch.device("meta"):
        first, second = _seeded("llama"), _seeded("llama")
    ids = second.args
    fresh = capture(first.model, ids, first.kwargs, cache=cache, claim=torch.device("cpu"))
    reused = capture(second.model, ids, second.kwargs, cache=cache, claim=torch.device("cpu"))
    assert cache.capture_hits == 1 and reused.module.code == fresh.module.code
    assert reused.traced_device == torch.device("cpu")
    own = dict(second.model.named_parameters())
    assert own and all(reused.module.get_parameter(n) is p for n, p in own.items())
    real = _seeded("llama")
    assert model_key(real.model, real.args, real.kwargs, ()) != \
        model_key(second.model, ids, second.kwargs, ())
