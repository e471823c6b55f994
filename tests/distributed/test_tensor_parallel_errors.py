"""tensor_parallel=T refused where it cannot run, before any process group is joined: one
process (device threads cannot share a layer), a T that does not divide the ranks, T searched
with a given pipeline, and the combinations not built yet."""

from __future__ import annotations

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError


def _gpt():
    return zoo.GPT(vocab=32, dim=8, layers=2, heads=2, seq=4).double(), torch.randint(0, 32, (4, 4))


def test_one_process_is_told_to_run_under_torchrun():
    model, x = _gpt()
    with pytest.raises(ConfigError, match=r"launch devices=2 x data_parallel=1 x "
                                          r"tensor_parallel=2 = 4 ranks with torchrun"):
        pc.compile(model, example_inputs=(x,), devices=2, tensor_parallel=2,
                   loss_fn=zoo.lm_loss)


def _torchrun(monkeypatch, world: int) -> None:
    """torchrun's variables, as compile reads them before joining (nothing is joined)."""
    for key, value in dict(RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="1").items():
        monkeypatch.setenv(key, value)


def test_a_t_that_does_not_divide_the_ranks_names_both(monkeypatch):
    _torchrun(monkeypatch, 4)
    model, x = _gpt()
    with pytest.raises(ConfigError, match=r"4 ranks \(tensor_parallel=3 does not divide "
                                          r"them\).*tensor_parallel=3 = 3"):
        pc.compile(model, example_inputs=(x,), devices=1, tensor_parallel=3,
                   loss_fn=zoo.lm_loss)


@pytest.mark.parametrize("options, what", [
    (dict(compile_stages=True), "compile_stages=True"),
    (dict(schedule="pipedream", optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
     "schedule='pipedream'"),
])
def test_combinations_not_built_yet_are_refused(monkeypatch, options, what):
    _torchrun(monkeypatch, 4 * options.get("data_parallel", 1))
    model, x = _gpt()
    with pytest.raises(ConfigError, match=f"tensor_parallel=2 with {what} is not built yet"):
        pc.compile(model, example_inputs=(x,), devices=2, tensor_parallel=2,
                   loss_fn=zoo.lm_loss, **options)


def test_a_given_t_with_a_searched_layout_is_refused(monkeypatch):
    """A given T with data_parallel="auto" under torchrun: give the layout or T="auto"."""
    _torchrun(monkeypatch, 4)
    model, x = _gpt()
    with pytest.raises(ConfigError, match="tensor_parallel=2 with a searched layout is planned "
                                          "for a cluster of devices that are not here.*or "
                                          "tensor_parallel='auto' with neither devices nor "
                                          "data_parallel"):
        pc.compile(model, example_inputs=(x,), tensor_parallel=2, data_parallel="auto",
                   loss_fn=zoo.lm_loss)


@pytest.mark.parametrize("options", [
    dict(devices=2),  # the pipeline given, T searched
    dict(devices=2, data_parallel=2),  # P and D given, T searched
])
def test_a_searched_t_with_a_given_pipeline_is_refused_under_torchrun(monkeypatch, options):
    """tensor_parallel="auto" under torchrun searches the whole layout P x D x T (it runs:
    tests/planner/test_layout_torchrun.py); with P or D given the error says what to leave
    out, before any process group is joined."""
    _torchrun(monkeypatch, 4)
    model, x = _gpt()
    with pytest.raises(ConfigError, match=r"tensor_parallel='auto' under torch.distributed "
                                          r"searches the whole layout of the 4 ranks \(P x D x "
                                          r"T\); leave devices and data_parallel out"):
        pc.compile(model, example_inputs=(x,), tensor_parallel="auto", loss_fn=zoo.lm_loss,
                   **options)


def test_a_searched_t_with_compiled_stages_is_refused_under_torchrun(monkeypatch):
    _torchrun(monkeypatch, 4)
    model, x = _gpt()
    with pytest.raises(ConfigError, match="tensor_parallel='auto' with compile_stages=True is "
                                          "not built yet"):
        pc.compile(model, example_inputs=(x,), tensor_parallel="auto", compile_stages=True,
                   loss_fn=zoo.lm_loss)


def test_a_searched_t_in_one_process_is_refused_saying_what_to_give():
    """In one process (device threads) tensor_parallel="auto" is planned for a cluster of
    absent devices only: the error says to give a cluster, or the layout under torchrun."""
    model, x = _gpt()
    with pytest.raises(ConfigError, match=r"tensor_parallel='auto' .*planned for a cluster of "
                                          r"devices that are not here.*under torchrun give the "
                                          r"layout \(devices=P, data_parallel=D, "
                                          r"tensor_parallel=T\)"):
        pc.compile(model, example_inputs=(x,), tensor_parallel="auto", loss_fn=zoo.lm_loss,
                   devices=["cpu", "cpu"])
