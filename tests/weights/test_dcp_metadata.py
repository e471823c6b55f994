"""dcp_metadata: a torch.distributed.checkpoint's `.metadata` is read without running code."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pipecompile.errors import CheckpointError
from pipecompile.weights.dcp_metadata import SafeReader, load_metadata


def _save(directory):
    state = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2, dtype=torch.float64)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return state


def test_metadata_reads_as_pickle_would_and_the_tensors_load(tmp_path):
    state = _save(tmp_path)
    safe = load_metadata(tmp_path / ".metadata")
    with open(tmp_path / ".metadata", "rb") as f:
        plain = pickle.load(f)  # the file written just above, in this test
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert {k: (tuple(m.size), m.properties.dtype) for k, m in safe.state_dict_metadata.items()} \
        == {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
    back = {k: torch.empty_like(t) for k, t in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(back, storage_reader=SafeReader(str(tmp_path)), no_dist=True)
    for key, tensor in state.items():
        assert torch.equal(back[key], tensor)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_metadata_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    _save(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CheckpointError, match=r"names io\.open, which is not part of"):
        load_metadata(tmp_path / ".metadata")
    with pytest.raises(CheckpointError, match=r"io\.open"):
        SafeReader(str(tmp_path)).read_metadata()
    assert not marker.exists()
