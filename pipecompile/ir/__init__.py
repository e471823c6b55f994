"""The records and helpers every floor shares (the runtime reads only these and schedule/).

    records.py        CapturedModel, LinearGraph, costs, Stage, StagedProgram, Example: records
    devices.py        DeviceSpec: a device as the cost model sees it
    nodes.py          small fx helpers: a node's target as text, attribute paths, node copies
    formats.py        the number formats every report and error uses (bytes, counts, stages)
    tensors.py        moving values between devices
    rng.py            per-micro-batch random streams (capture seeds graphs, the runtime draws)
    compile_cache.py  one bounded, content-keyed cache of what compiling measures or derives
    progress.py       what compile is doing, logged: each pass as it ends, counts of long loops
    shard_plan.py     a tensor-parallel split: each parameter's placement, what stayed whole
"""
