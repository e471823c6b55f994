"""Partition drawings: matplotlib SVG/PNG and the graphviz source."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

import pipecompile as pc
from pipecompile.outputs.draw import partition_dot
from tests.support.models import CASES


@pytest.fixture(scope="module")
def unet_pipe():
    torch.manual_seed(0)
    case = CASES["unet"]()
    return pc.compile(case.model, case.args, devices=3, microbatches=2, symbolic_sizes="all")


def test_matplotlib_svg_and_png(unet_pipe, tmp_path):
    svg = unet_pipe.draw(str(tmp_path / "partition.svg"), backend="matplotlib")
    text = open(svg).read()
    assert "<svg" in text
    for block in unet_pipe.program.linear.blocks:  # every block is labelled, in order
        assert f"{block.index}  {block.name}" in text
    assert "cut 0:" in text and "cut 1:" in text and "cut 2:" not in text
    png = unet_pipe.draw(str(tmp_path / "partition.png"), backend="matplotlib")
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_graphviz_source_has_a_cluster_per_stage_and_labelled_cuts(unet_pipe):
    dot = partition_dot(unet_pipe.program, microbatches=unet_pipe.plan.resolved.microbatches)
    assert dot.startswith("digraph partition {") and dot.rstrip().endswith("}")
    assert len(re.findall(r"subgraph cluster_\d+", dot)) == 3
    cut_edges = [line for line in dot.splitlines() if "color=red" in line]
    assert len(cut_edges) == 2
    # the U-Net's long skip (enc1's output) crosses both cuts, to the last stage
    assert all("relu: float64[batch, 4, x.size(2), x.size(3)]" in line for line in cut_edges)
    n = len(unet_pipe.program.linear.blocks)
    assert len(re.findall(r"b\d+ -> b\d+", dot)) == n - 1


def test_bad_extension_and_missing_dot(unet_pipe, tmp_path):
    with pytest.raises(pc.ConfigError, match=r"ending in \.svg or \.png"):
        unet_pipe.draw(str(tmp_path / "partition.jpg"))
    if shutil.which("dot") is None:
        with pytest.raises(pc.ConfigError, match="install graphviz"):
            unet_pipe.draw(str(tmp_path / "p.svg"), backend="graphviz")
