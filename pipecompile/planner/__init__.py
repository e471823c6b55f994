"""The planner: compile's options, the searches that choose the plan, and what it costs.

    options.py        compile's inputs validated once: the model, its example batch, the options
    plan.py           the plan record the passes advance, their contracts, the pass runner
    choose.py         the passes that choose the plan's shape before the model is cut
    block_tables.py   the block costs a search prices candidates with, each made once
    choices.py        what compile resolved of its options (the search pass's record)
    planning.py       cost, place, refine: the planner's decisions as pure functions
    search.py         which schedule, micro-batch count, virtual stages and recomputation
    device_share.py   virtual stages placed so that together they fit their device
    stage_costs.py    block costs -> what the simulator needs (one path for search and split)
    hardware.py       named accelerators: datasheet figures and sustained fractions
    assembly.py       a finished plan -> its RuntimeSpec
  at scale (pipeline x data parallel, absent clusters):
    cluster.py        `cluster("h100", nodes=8, per_node=8)`: devices and link levels
    collectives.py    alpha-beta prices of reduce-scatter, all-gather, all-reduce per link level
    layout.py         a layout (P x D, FSDP, which dimension stays inside a node) and its costs
    layout_options.py compile's options for a searched or given layout
    layout_ranks.py   the ranks of a job whose layout is searched under torchrun
    layout_search.py  every layout searched with the schedule search, the best kept
    search_layouts.py the layout search's candidates and their plans
    throughput.py     tokens (samples) per second per device and MFU of a plan
    breakdown.py      where the predicted step goes: compute by kernel kind, optimizer, bubble
"""
