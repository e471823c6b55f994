"""Clusters of absent devices and the alpha-beta prices of their collectives."""

from __future__ import annotations

import pytest

import pipecompile
from pipecompile.errors import ConfigError
from pipecompile.planner import cluster as cluster_module
from pipecompile.planner.cluster import Cluster, Link, cluster, is_cluster
from pipecompile.planner.collectives import Group, all_gather, all_reduce, reduce_scatter


def test_an_h100_cluster_has_its_devices_and_two_link_levels():
    c = cluster("h100", nodes=8, per_node=8)
    assert pipecompile.cluster is cluster and cluster_module.cluster is cluster
    assert len(c) == 64 and is_cluster(c) and not is_cluster([c[0]] * 64)
    assert c[0] is c[63] and list(c)[5] == c[5] and len(c[:10]) == 10
    assert c.device.flops == pytest.approx(0.71 * 989.4e12)
    assert (c.intra.name, c.intra.bandwidth, c.intra.latency, c.intra.step_latency) == (
        "nvlink", pytest.approx(0.8 * 450e9), 10e-6, 3.4e-6)  # a ring step: NCCL's model
    assert (c.inter.name, c.inter.bandwidth, c.inter.latency, c.inter.step_latency) == (
        "infiniband", pytest.approx(0.8 * 50e9), 20e-6, 20e-6)
    assert c.link(0, 7) is c.intra and c.link(7, 8) is c.inter and c.node_of(63) == 7
    assert c.spec_sending(c.inter).bandwidth == c.inter.bandwidth
    assert "8 x 8 NVIDIA H100" in str(c)


@pytest.mark.parametrize("call, message", [
    (lambda: cluster("tpu-v5", nodes=2), "no device preset named 'tpu-v5'; presets: h100, a100, h200"),
    (lambda: cluster("h100", nodes=0), "nodes must be a positive int, got 0"),
    (lambda: cluster("h100", inter="ethernet"), "has no link 'ethernet'"),
])
def test_bad_clusters_say_what_exists(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
    with pytest.raises(IndexError):
        Cluster(cluster("a100").device, 1, 2, Link("a", 1.0, 0.0), Link("b", 1.0, 0.0))[2]


NV, IB = Link("nvlink", 400e9, 1e-5), Link("infiniband", 50e9, 2e-5)


def test_collectives_follow_the_hierarchical_ring_volumes():
    S, base = 8e9, 8.4e-6  # NCCL's fixed cost of one ring collective (Ring / Simple)
    # one node of 8: (g-1)/g of S over NVLink, 7 steps
    assert reduce_scatter(S, Group(8, 1), NV, IB) == pytest.approx(
        7 / 8 * S / 400e9 + 7e-5 + base)
    # one device per node on 4 nodes: (k-1)/k of S over the NIC
    assert reduce_scatter(S, Group(1, 4), NV, IB) == pytest.approx(
        3 / 4 * S / 50e9 + 3 * 2e-5 + base)
    # 8 x 8: the inter-node phase moves S / 8 per device
    both = reduce_scatter(S, Group(8, 8), NV, IB)
    assert both == pytest.approx(
        7 / 8 * S / 400e9 + 7e-5 + 7 / 8 * S / 8 / 50e9 + 7 * 2e-5 + base)
    assert all_gather(S, Group(8, 8), NV, IB) == both
    assert all_reduce(S, Group(8, 8), NV, IB) == pytest.approx(2 * both - base)  # one collective


def test_a_ring_step_over_nvlink_costs_what_nccls_model_says():
    """NCCL's tuning model (src/graph/tuning.cc, Ring / Simple): 8.4 us + 3.4 us per step; a
    TP8 all-reduce of 32 MiB inside a DGX A100 at 0.8 x 300 GB/s: 14 steps."""
    nv = cluster("a100").intra
    S = 2 ** 25
    assert all_reduce(S, Group(8, 1), nv, nv) == pytest.approx(
        2 * 7 / 8 * S / 240e9 + 14 * 3.4e-6 + 8.4e-6)
    assert Link("x", 1e9, 1e-6).step_latency == 1e-6
    assert all_reduce(S, Group(1, 1), NV, IB) == 0.0 and Link("x", 1e9, 1e-6).send(0) == 0.0
