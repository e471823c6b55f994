"""outputs/persist_tensor.py: a saved tensor-parallel pipeline records P x D x T and is refused
outside its ranks. Saving and loading one under real ranks (the same sharded pipeline, its
next step bit for bit the original's) is tests/distributed/test_tensor_parallel_exact.py."""

from __future__ import annotations

import pytest

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import ConfigError
from pipecompile.outputs.persist_tensor import join_saved, layout_to_json


def test_loading_a_tensor_parallel_pipeline_in_one_process_says_how_to_launch_it():
    layout = {"pipeline": 2, "data_parallel": 1, "tensor_parallel": 2}
    with pytest.raises(ConfigError, match=r"2 pipeline x 1 data-parallel x 2 tensor-parallel "
                                          r"= 4 ranks.*torchrun --nproc-per-node 4"):
        join_saved(layout, timeout=10.0)


def test_a_plan_without_layout_writes_none_and_a_cluster_plan_keeps_its_t():
    import torch

    model = zoo.GPT(vocab=64, dim=16, layers=2, heads=2, seq=8)
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert layout_to_json(pc.compile(model, (ids,), devices=2).plan) is None
    planned = pc.compile(model, (ids,), devices=pc.cluster("a100", nodes=1, per_node=8),
                         data_parallel=2, tensor_parallel=2)
    saved = layout_to_json(planned.plan)
    assert saved is not None and (saved["pipeline"], saved["data_parallel"],
                                  saved["tensor_parallel"]) == (2, 2, 2)
