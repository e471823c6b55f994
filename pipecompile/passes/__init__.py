"""Compiler passes: each is a function from IR to new IR, testable on its own.

    inplace.py    make in-place ops on activations safe to cut around (run at capture)
    linearize.py  the captured graph as a chain of blocks, with the values crossing each cut
    annotate.py   the cost of every block and cut, symbolic in the batch (and other) sizes
    kernels.py    each op priced as a GPU runs it (the kernel model of absent devices)
    flops.py      torch's FLOP counter, with rules for the CPU's fused attention
    fake_values.py  the fake stand-ins a block is costed on, and fewer symbols where it fails
    kernel_prices.py  one kernel's seconds from its shape and a chip's published figures
    calibrate.py  block costs corrected by the stages' measured times
    partition.py  the chain cut into pipeline stages: the placement policy
    chain_arrays.py  partition's placement DP on numpy arrays (the same bits, faster)
    split.py      one fx.GraphModule per stage, with named inputs and outputs
    eval_mode.py  the inference version of a graph captured in training mode
    tensor_shard.py  tensor parallelism: column/row pairs chosen from a stage graph, lowered
                  to local shards plus Megatron's copy/reduce (per-op rules: tensor_rules.py)
    vocab_loss.py  split logits read only by a cross entropy: it lowered vocabulary-parallel
    sequence_shard.py  sequence parallelism: a lowered graph's tokens between each row and
                  the next column split over the T ranks (reduce-scatter / all-gather)
"""
