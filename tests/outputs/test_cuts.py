"""cuts: the values crossing each cut and their sizes per micro-batch."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile.outputs.cuts import cuts, microbatch_size
from tests.support.models import CASES


def test_unet_long_skip_crosses_every_cut_to_its_reader():
    torch.manual_seed(0)
    case = CASES["unet"]()  # batch 8, float64, 8x8 images, width 4
    pipe = pc.compile(case.model, case.args, devices=3, microbatches=4, symbolic_sizes="all")
    assert microbatch_size(pipe.program, 4) == 2
    result = cuts(pipe.program, microbatches=4)
    assert [c.index for c in result] == [0, 1]
    for cut in result:
        assert cut.after_block == pipe.program.stages[cut.index].blocks[-1]
        names = [v.name for v in cut.values]
        assert "relu" in names  # enc1's output, read by the last decoder
        skip = cut.values[names.index("relu")]
        # the image size is symbolic too: the U-Net runs any size its pooling allows
        assert skip.shape == ("batch", 4, "x.size(2)", "x.size(3)")
        assert skip.microbatch_shape == (2, 4, 8, 8)
        assert skip.nbytes == 2 * 4 * 8 * 8 * 8 and skip.dtype == "float64"
        assert skip.producer == 0 and skip.consumers == (2,)
    # the sizes are those of the real tensors crossing each cut: run the stages on one real
    # micro-batch; cut j carries what a stage <= j returns and a stage > j reads
    real = {"x": case.args[0].chunk(4)[0]}
    with torch.no_grad():
        for stage in pipe.program.stages:
            real.update(zip(stage.outputs, stage.module(*[real[n] for n in stage.inputs])))
    for cut in result:
        sent = {n for s in pipe.program.stages[:cut.index + 1] for n in s.outputs}
        read = {n for s in pipe.program.stages[cut.index + 1:] for n in s.inputs}
        assert {v.name for v in cut.values} == sent & read
        for v in cut.values:
            assert v.microbatch_shape == tuple(real[v.name].shape), v
            assert v.nbytes == real[v.name].numel() * real[v.name].element_size(), v
        assert cut.nbytes == sum(real[n].numel() * real[n].element_size() for n in sent & read)
    # by hand, 2 samples of float64: enc1, enc2 and enc3's outputs (4x8x8, 8x4x4, 16x2x2), then
    # enc1's and dec2's convolution's (4x4x4)
    assert [cut.nbytes for cut in result] == [2 * 8 * (4 * 64 + 8 * 16 + 16 * 4),
                                              2 * 8 * (4 * 64 + 4 * 16)]
    # every value sent forward appears in the cuts between its producer and its readers
    for name, producer in pipe.program.producer.items():
        last = max(pipe.program.consumers[name])
        crossing = [c.index for c in result if name in {v.name for v in c.values}]
        assert crossing == list(range(producer, last))
