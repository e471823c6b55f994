"""The planner's scale-out half: clusters of absent devices, their collectives, pricing each op
as the hardware runs it, and the search over layouts (pipeline x data parallel).

    cluster.py      `cluster("h100", nodes=8, per_node=8)`: devices and link levels
    collectives.py  alpha-beta prices of reduce-scatter, all-gather, all-reduce per link level
    kernels.py      an op as a GPU runs it: matmul roofline, fused attention, bytes at HBM speed
    layout.py       a layout (P x D, FSDP, which dimension stays inside a node) and its costs
    layout_search.py  every layout searched with the schedule search, the best kept
    throughput.py   tokens (samples) per second per device and MFU of a plan
"""
