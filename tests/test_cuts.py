"""cuts: the values crossing each cut and their sizes per micro-batch."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile.cuts import cuts, microbatch_size
from tests.models import CASES


def test_unet_long_skip_crosses_every_cut_to_its_reader():
    torch.manual_seed(0)
    case = CASES["unet"]()  # batch 8, float64, 8x8 images, width 4
    pipe = pc.compile(case.model, case.args, devices=3, microbatches=4)
    assert microbatch_size(pipe.program, 4) == 2
    result = cuts(pipe.program, microbatches=4)
    assert [c.index for c in result] == [0, 1]
    for cut in result:
        assert cut.after_block == pipe.stages[cut.index].blocks[-1]
        names = [v.name for v in cut.values]
        assert "relu" in names  # enc1's output, read by the last decoder
        skip = cut.values[names.index("relu")]
        # the image size is symbolic too: the U-Net runs any size its pooling allows
        assert skip.shape == ("batch", 4, "x.size(2)", "x.size(3)")
        assert skip.microbatch_shape == (2, 4, 8, 8)
        assert skip.nbytes == 2 * 4 * 8 * 8 * 8 and skip.dtype == "float64"
        assert skip.producer == 0 and skip.consumers == (2,)
        assert cut.nbytes == sum(v.nbytes for v in cut.values)
    # every value sent forward appears in the cuts between its producer and its readers
    for name, producer in pipe.program.producer.items():
        last = max(pipe.program.consumers[name])
        crossing = [c.index for c in result if name in {v.name for v in c.values}]
        assert crossing == list(range(producer, last))
