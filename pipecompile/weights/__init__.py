"""A model's tensors: read from checkpoints, or given memory for a model built on meta.

    read.py         named tensors out of a checkpoint on disk, touching only what was asked for
    dcp_metadata.py a torch.distributed.checkpoint's metadata read without running code
    load.py         this process's tensors from a checkpoint, strictly, as `from_pretrained` does
    shard_slices.py a sharded tensor's slice read alone; a fused one shown to DCP as its pieces
    hf_keys.py      which checkpoint tensors make each model tensor (transformers' conversions)
    materialize.py  memory for this process's stages of a meta model, initialisation
    unwritten.py    tensors `to_empty` allocated that nothing has written since
"""
