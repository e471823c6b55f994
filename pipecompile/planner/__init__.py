"""The planner: what the user asked, the passes that resolve and plan it, and what a plan costs.

  the request and its resolution:
    request.py         compile's options as one frozen, grouped `Request`, each value checked
    options.py         the options checked against each other, the example and the ranks
    layout_options.py  the starting options when the layout (P x D x T, FSDP) is searched
    resolved.py        the search's `Choices`, the `Resolved` record and `resolve`: what the
                       join, search and ranks passes resolved (layout, devices, schedule, ...)
  the recipe and its passes:
    recipe.py          the passes as one flat list (`PASSES`) and `plan_for`
    plan.py            the plan record the passes advance, their contracts, the pass runner
    ranks_passes.py    join and ranks: the job's process group, link and this rank's place
    shape_passes.py    probe, search, schedule: the plan's shape before the model is cut
    layout_passes.py   the search pass when the layout is searched
    model_passes.py    capture, linearize, annotate, partition, calibrate, refine, split,
                       threads, simulate, plan check, shard
  the decisions and their prices:
    decisions.py       cost, place, refine: the planner's decisions as pure functions
    schedule_search.py which schedule, micro-batch count, virtual stages and recomputation
    built_schedules.py the schedules a search builds, each once, kept for the next layouts
    layout_search.py   every layout searched with the schedule search, the best kept
    layout.py          a layout (P x D x T, FSDP, which dimension stays inside a node), its costs
                       and what the search found of it (`LayoutCandidate`)
    tensor_costs.py    one rank's share of the block costs under tensor parallelism
    logits_loss.py     how the pipeline's loss reads the outputs (split logits gathered or not)
    block_tables.py    the block costs a search prices candidates with, each made once
    device_share.py    virtual stages placed so that together they fit their device
    stage_costs.py     block costs -> what the simulator needs (one path for search and split)
    hardware.py        named accelerators: datasheet figures and sustained fractions
    cluster.py         `cluster("h100", nodes=8, per_node=8)`: devices and link levels
    collectives.py     alpha-beta prices of reduce-scatter, all-gather, all-reduce per level
    throughput.py      tokens (samples) per second per device and MFU of a plan
    breakdown.py       where the predicted step goes: compute by kernel kind, optimizer, bubble
    assembly.py        a finished plan -> its RuntimeSpec
"""
