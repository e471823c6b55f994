"""Runtime: stage workers, transports, and the executor that runs each device's generated step.

  what it is given and how it is assembled:
    spec.py                 `RuntimeSpec` (what the runtime reads of a plan) and `StepResult`
    assemble.py             `assemble`: the runtime of a program for this process
    workers.py              one `StageWorker` per stage, behaviours chosen once; optimizers
    step_driver.py          `Runtime`: runs a step, a stream, an evaluation; clips gradients
    stage_modes.py          train/eval mode: the stage graphs or their eval-mode forms
    local_runtime.py        `LocalRuntime`: every stage in this process, a `Mailbox`
    distributed_runtime.py  `DistributedRuntime`: this rank's stages over torch.distributed
    training.py             autocast in device threads, tied copies, the global gradient norm
  one stage:
    stage_worker.py         `StageWorker`: a stage's behaviours, one micro-batch at a time
    stage_call.py           how a stage's module is called
    forwards.py             training-forward behaviours (kept, recomputed)
    backwards.py            backward behaviours (fused, split, compiled, versioned)
    split_backward.py       backward split into input (I) and weight (W) gradients
    weight_store.py         zero-bubble W at the op: weight gradients held until W
    direct_forward.py       a stage graph's forward as direct calls
    op_binding.py           which Python binding stands for an ATen overload in emitted code
    stage_loss.py           the last stage's loss
    in_flight.py            what a stage holds between a forward and its backward
    rng_state.py            the random state a recomputed forward replays
    thread_state.py         grad mode and autocast put back after a stage's compute
    versions.py             weight versions of the asynchronous schedules
    compiled.py             stage graphs through torch.compile (compile_stages=True)
    memory.py               a step's saved activations, counted as it runs
  the step and its messages:
    codegen.py              each device's row emitted as one straight-line function
    executor.py             runs the generated rows over the workers
    stage_steps.py          the synchronous STEP actions
    transport.py            the `Transport` protocol
    mailbox.py              the in-process transport between device threads
    p2p.py                  the transport between ranks (point-to-point)
    microbatch.py           a batch split into micro-batches along dim 0
    values.py               boundary values as the runtime and the cost model size them
  several processes and devices:
    distributed.py          topology, plan check, gradient and loss reductions
    data_parallel.py        gradients reduced over replicas (DDP's reducer, FSDP's hooks)
    tensor_parallel.py      the tensor-parallel group and its sharded stages
    vocab_loss.py           the vocabulary-parallel cross entropy; the loss of split logits
  seeing it run:
    profiling.py            every action as a `torch.profiler.record_function` range
    plot.py                 Gantt charts of timelines
"""
