"""pipecompile/weights/read.py: reading a subset of a checkpoint from safetensors files, transformers
shards and torch.distributed.checkpoint directories, opening only what holds the wanted keys."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import pipecompile as pc
from pipecompile.weights import read as weights
from pipecompile.weights.read import checkpoint_format, checkpoint_keys, read_tensors


class _Recorder:
    """Wraps `safe_open` as weights.py imports it: records each file opened and tensor read."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], []

    def __call__(self, file, framework, device="cpu"):
        self.opened.append(Path(file).name)
        recorder, handle = self, self.real(file, framework, device=device)

        class Handle:
            def __enter__(self):
                self.inner = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, key):
                recorder.read.append(key)
                return self.inner.get_tensor(key)

            def __getattr__(self, name):  # keys, get_slice: header only
                return getattr(self.inner, name)

        return Handle()


@pytest.fixture
def recorder(monkeypatch):
    rec = _Recorder(weights.safe_open)
    monkeypatch.setattr(weights, "safe_open", rec)
    return rec


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny tied-embedding Llama and its save_pretrained output: several shards plus an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True))
    out = tmp_path_factory.mktemp("llama")
    model.save_pretrained(out, max_shard_size="10KB")  # ~23 KB of weights -> 3 shards
    return model, out


def _index(directory):
    return json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]


def test_single_file_reads_requested_keys_only_in_saved_dtype(tmp_path, recorder):
    saved = {"w": torch.randn(3, 4), "b": torch.randn(4, dtype=torch.bfloat16),
             "step": torch.arange(5)}
    file = tmp_path / "weights.safetensors"
    save_file(saved, file)
    assert checkpoint_format(file) == "safetensors"
    assert checkpoint_keys(file) == {"w": ((3, 4), torch.float32), "b": ((4,), torch.bfloat16),
                                     "step": ((5,), torch.int64)}
    assert recorder.read == []  # keys come from the header
    got = read_tensors(file, ["b", "step", "absent"])
    assert set(got) == {"b", "step"}  # a missing key is simply absent
    assert got["b"].dtype == torch.bfloat16 and torch.equal(got["b"], saved["b"])
    assert torch.equal(got["step"], saved["step"])
    assert sorted(recorder.read) == ["b", "step"]  # "w" never read


def test_transformers_shards_match_the_model_state_dict(llama, recorder):
    model, directory = llama
    assert len(set(_index(directory).values())) >= 3
    assert checkpoint_format(directory) == "shards"
    state = model.state_dict()
    tied = {"lm_head.weight"}  # save_pretrained drops the tied copy of the embedding
    assert checkpoint_keys(directory) == {k: (tuple(v.shape), v.dtype)
                                          for k, v in state.items() if k not in tied}
    assert recorder.read == []
    got = read_tensors(directory, state)
    assert set(got) == set(state) - tied
    for key, tensor in got.items():
        assert torch.equal(tensor, state[key]), key


def test_keys_of_one_shard_open_only_that_shard(llama, recorder):
    _, directory = llama
    weight_map = _index(directory)
    shard = weight_map["model.layers.1.input_layernorm.weight"]
    keys = sorted(k for k, f in weight_map.items() if f == shard)[:2]
    got = read_tensors(directory, keys)
    assert sorted(got) == keys
    assert recorder.opened == [shard]
    assert sorted(recorder.read) == keys


def test_bf16_shards_read_back_as_bf16(llama, tmp_path):
    model, _ = llama
    bf16 = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="10KB")
    model.to(torch.float32)  # the fixture is shared: give it back as it was
    key = "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_keys(tmp_path)[key] == ((32, 16), torch.bfloat16)
    got = read_tensors(tmp_path, [key])[key]
    assert got.dtype == torch.bfloat16 and torch.equal(got, bf16[key])


def test_directory_with_one_model_safetensors_and_no_index(tmp_path):
    saved = {"a": torch.randn(2, 2), "b": torch.randn(3)}
    save_file(saved, tmp_path / "model.safetensors")
    assert checkpoint_format(tmp_path) == "shards"
    assert checkpoint_keys(tmp_path) == {"a": ((2, 2), torch.float32), "b": ((3,), torch.float32)}
    got = read_tensors(tmp_path, ["b"])
    assert list(got) == ["b"] and torch.equal(got["b"], saved["b"])


def _save_dcp(directory):
    saved = {"layer.w": torch.randn(4, 3), "layer.b": torch.randn(3, dtype=torch.bfloat16),
             "ids": torch.arange(6), "step": 7}  # "step" is not a tensor: stored as bytes
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(saved, checkpoint_id=directory, no_dist=True)
    return saved


def test_dcp_reads_a_subset_of_keys(tmp_path, monkeypatch):
    saved = _save_dcp(tmp_path)
    read_items = []
    real_read_data = dcp.FileSystemReader.read_data

    def read_data(self, plan, planner):
        read_items.extend(item.dest_index.fqn for item in plan.items)
        return real_read_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", read_data)
    assert checkpoint_format(tmp_path) == "dcp"
    assert checkpoint_keys(tmp_path) == {"layer.w": ((4, 3), torch.float32),
                                         "layer.b": ((3,), torch.bfloat16),
                                         "ids": ((6,), torch.int64)}
    assert read_items == []  # metadata only
    got = read_tensors(tmp_path, ["layer.b", "ids", "step", "absent"])
    assert set(got) == {"layer.b", "ids"}
    assert got["layer.b"].dtype == torch.bfloat16 and torch.equal(got["layer.b"], saved["layer.b"])
    assert torch.equal(got["ids"], saved["ids"])
    assert sorted(read_items) == ["ids", "layer.b"]
    assert read_tensors(tmp_path, ["absent"]) == {}


def test_dcp_read_uses_no_collectives_when_a_process_group_is_up(tmp_path, monkeypatch):
    saved = _save_dcp(tmp_path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def collective(*args, **kwargs):
            raise AssertionError("read_tensors must not call collectives")

        for name in ("all_gather_object", "gather_object", "scatter_object_list",
                     "broadcast_object_list", "barrier", "all_reduce"):
            monkeypatch.setattr(dist, name, collective)
        got = read_tensors(tmp_path, ["layer.w"])
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert torch.equal(got["layer.w"], saved["layer.w"])


def _assert_lists_formats(message, path):
    assert str(path) in message
    assert ".safetensors file" in message and "model.safetensors.index.json" in message
    assert "torch.distributed.checkpoint" in message


@pytest.mark.parametrize("kind", ["missing", "bin_directory", "pt_file", "empty_directory"])
def test_unreadable_paths_name_the_path_and_the_accepted_formats(tmp_path, kind):
    path = tmp_path / "ckpt"
    if kind == "bin_directory":
        path.mkdir()
        torch.save({"w": torch.zeros(1)}, path / "pytorch_model.bin")
    elif kind == "pt_file":
        path = tmp_path / "ckpt.pt"
        torch.save({"w": torch.zeros(1)}, path)
    elif kind == "empty_directory":
        path.mkdir()
    for call in (checkpoint_format, checkpoint_keys, lambda p: read_tensors(p, ["w"])):
        with pytest.raises(pc.CheckpointError) as info:
            call(path)
        assert isinstance(info.value, ValueError)
        _assert_lists_formats(str(info.value), path)


def test_several_safetensors_without_an_index_ask_for_one(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "part1.safetensors")
    save_file({"b": torch.zeros(1)}, tmp_path / "part2.safetensors")
    with pytest.raises(pc.CheckpointError, match="no model.safetensors.index.json") as info:
        checkpoint_keys(tmp_path)
    _assert_lists_formats(str(info.value), tmp_path)


def test_index_naming_a_missing_shard_names_the_key_and_the_file(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}))
    assert read_tensors(tmp_path, ["a"]).keys() == {"a"}  # the missing shard is not needed
    for call in (checkpoint_keys, lambda p: read_tensors(p, ["a", "b"])):
        with pytest.raises(pc.CheckpointError, match="'b'.*'model-2.safetensors'"):
            call(tmp_path)


def test_index_and_shard_header_that_disagree(tmp_path):
    save_file({"a": torch.zeros(1)}, tmp_path / "model-1.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-1.safetensors", "c": "model-1.safetensors"}}))
    with pytest.raises(pc.CheckpointError, match="holds \\['c'\\].*re-save"):
        read_tensors(tmp_path, ["c"])


def test_the_weights_folder_names_each_of_its_modules():
    import pipecompile.weights as folder

    from tests.support.folders import unlisted

    assert unlisted(folder) == []
