"""planner/logits_loss.py and the price of a split output layer (planner/tensor_costs.py):
split logits only a cross entropy reads are priced as they run, never gathered and their
loss at 1/T; any other loss prices the all-gather and the whole loss on every rank."""

from __future__ import annotations

import sympy
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.ir.shard_plan import VocabularyLayer
from pipecompile.passes.kernels import Kernels
from pipecompile.passes.tensor_shard import vocabulary_layers
from pipecompile.planner.collectives import Group, all_gather, all_reduce
from pipecompile.planner.logits_loss import loss_reads
from pipecompile.planner.tensor_costs import TensorShare, _shard_kernels, vocabulary_price

C = pc.cluster("h100", nodes=1, per_node=8)


def _square(logits, target):
    return zoo.lm_loss(logits, target) + logits.pow(2).mean()


def test_the_pipelines_loss_is_read_as_it_will_run():
    """GPT's logits: zoo.lm_loss reads them through a cross entropy, a loss adding their
    squares does not, no loss_fn reads nothing; the output layer's `loss` follows."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=64, dim=16, layers=1, heads=2, seq=8, tied=False)
    pipe = pc.compile(model, (torch.zeros(2, 8, dtype=torch.long),), devices=["cpu"],
                      loss_fn=zoo.lm_loss, microbatches=1, schedule="gpipe")
    captured = pipe.plan.captured
    reads = {fn: loss_reads(captured, fn) for fn in (zoo.lm_loss, _square, None)}
    assert reads == {zoo.lm_loss: {0: "cross entropy"}, _square: {0: "other"}, None: {0: "none"}}
    for fn, loss in ((zoo.lm_loss, "parallel"), (_square, "gathered"), (None, "parallel")):
        (head,) = [layer for layer, *_ in vocabulary_layers(captured.module, 2,
                                                              loss_reads=reads[fn])
                   if layer.name == "lm_head.weight"]
        assert head.loss == loss, fn
    # class weights (a constant of the loss, on the CPU beside meta logits) and label
    # smoothing lower at run time (runtime/vocab_loss.py): priced so
    weight = torch.rand(64)

    def weighted(logits, target):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 64), target.reshape(-1),
                                                 weight=weight, label_smoothing=0.1)

    assert loss_reads(captured, weighted) == {0: "cross entropy"}
    # a target given (the example's) is what the loss is traced with
    assert loss_reads(captured, zoo.lm_loss, torch.zeros(2, 8, dtype=torch.long)) == \
        {0: "cross entropy"}


def test_a_split_output_layer_prices_the_gather_only_when_its_logits_are_gathered():
    """Llama-3-70B's output layer at TP8 over 8192 tokens: split with a parallel cross
    entropy costs its two small all-reduces (n and 2n elements) where the gathered split
    costs the logits' all-gather (n V elements); the GEMM and its input's all-reduce alike."""
    share = TensorShare(8, C.intra)
    price = {loss: vocabulary_price(VocabularyLayer("head", 128256, 8192, ("output",), 8192,
                                                    2, loss), share, flops=1e15,
                                    optimizer_factor=2.0)
             for loss in ("parallel", "gathered")}
    group = Group(8, 1)
    gather = all_gather(8192 * 128256 * 2, group, C.intra, C.intra)
    ce = (all_reduce(8192 * 2, group, C.intra, C.intra)
          + all_reduce(2 * 8192 * 2, group, C.intra, C.intra))
    assert abs((price["gathered"].split - price["parallel"].split) - (gather - ce)) < 1e-12
    assert price["gathered"].whole == price["parallel"].whole


def test_the_loss_over_gathered_logits_stays_whole_and_over_parallel_ones_splits():
    """`_shard_kernels` of a block holding the output layer (V = 128) and its loss: split
    with a parallel cross entropy, the loss runs 1/T; gathered, whole on every rank (the
    GEMM 1/T either way); each records the logits it prices collectives for."""
    tokens, width, vocab = 64, 32, 128
    gemm = (sympy.Integer(tokens), sympy.Integer(vocab), sympy.Integer(width), sympy.Integer(1),
            2, 1)
    loss = sympy.Integer(tokens * vocab * 16)
    k = Kernels(gemms=(gemm,), moves=((loss, 1),), ruled=((loss, loss * 20 / 16, 1),),
                memory=loss, launches=2)
    parallel = _shard_kernels(k, 2, float, 0.0, False, outputs={(vocab, width): "parallel"})
    gathered = _shard_kernels(k, 2, float, 0.0, False, outputs={(vocab, width): "gathered"})
    assert parallel.kernels.moves == ((loss / 2, 1),)
    assert gathered.kernels.moves == ((loss, 1),) and gathered.kernels.ruled == k.ruled
    assert parallel.logits == ((64.0, vocab, 2, "parallel"),)
    assert gathered.logits == ((64.0, vocab, 2, "gathered"),)
    for found in (parallel, gathered):
        assert found.kernels.gemms[0][1] == sympy.Integer(vocab) / 2
