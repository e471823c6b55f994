"""ir.py: the records every pass reads and writes: symbolic sizes and bytes of values, the
micro-batch size torch.chunk gives, a captured model's size symbols and call structure."""

from __future__ import annotations

import pytest
import sympy
import torch

from pipecompile.capture.capture import capture
from pipecompile.ir.records import Block, NumericBlockCost, ValueInfo, evaluate, microbatch_size


def test_value_info_bytes_are_symbolic_in_the_sizes():
    b, s = sympy.symbols("b s", positive=True, integer=True)
    value = ValueInfo("h", (b, s, 16), torch.bfloat16)
    assert value.is_tensor
    assert value.numel == 16 * b * s
    assert value.nbytes == 32 * b * s
    # at b = 3, s = 5: the bytes of the real tensor
    real = torch.empty(3, 5, 16, dtype=torch.bfloat16)
    assert evaluate(value.nbytes, {b: 3, s: 5}) == real.numel() * real.element_size()
    assert repr(value) == "h: bfloat16[b, s, 16]"
    size = ValueInfo("n", (), None)  # a SymInt or Python scalar: one int64 on the wire
    assert not size.is_tensor and size.nbytes == 8 and repr(size) == "n: scalar[]"
    assert ValueInfo("c", (), torch.float64).nbytes == 8  # a 0-d tensor: one element


@pytest.mark.parametrize("batch,m", [(8, 4), (10, 4), (9, 3), (7, 7), (5, 2)])
def test_microbatch_size_is_the_largest_torch_chunk_piece(batch, m):
    pieces = torch.arange(batch).chunk(m)
    assert microbatch_size(batch, m) == max(len(p) for p in pieces)


def test_evaluate_substitutes_sizes_and_refuses_unbound_symbols():
    b = sympy.Symbol("b")
    assert evaluate(2 * b + 1, {b: 4}) == 9.0
    assert evaluate(7, {}) == 7.0
    assert evaluate(sympy.oo, {}) == 0.0  # an infinite cost counts as none
    with pytest.raises(AssertionError, match="unbound symbols"):
        evaluate(b * sympy.Symbol("s"), {b: 2})


def test_evaluate_remembers_a_value_per_expression_and_sizes():
    """A value is remembered for its expression and sizes (the searches ask again and again),
    so a second call substitutes nothing; other sizes give their own value."""
    from pipecompile.ir import records

    b, s = sympy.symbols("b_mem s_mem", positive=True, integer=True)
    expr = 3 * b * s + b ** 2 / 7
    first = evaluate(expr, {b: 4, s: 9})
    before = records._evaluate_at.cache_info().hits
    assert evaluate(expr, {b: 4, s: 9}) == first == float((3 * b * s + b ** 2 / 7).subs(
        {b: 4, s: 9}))
    assert records._evaluate_at.cache_info().hits == before + 1
    assert evaluate(expr, {b: 5, s: 9}) == float(expr.subs({b: 5, s: 9}))
    with pytest.raises(AssertionError, match="unbound"):  # not remembered as a value
        evaluate(expr, {b: 4})


def test_block_cost_times_add_up_and_blocks_print_short():
    cost = NumericBlockCost(forward_flops=1.0, backward_flops=2.0, forward_time=0.5,
                            backward_input_time=0.25, backward_weight_time=0.75,
                            static_bytes=0.0, activation_bytes=0.0, param_count=3)
    assert cost.backward_time == 1.0 and cost.time == 1.5
    assert repr(Block(2, "layers.1", ("a", "b"))) == "Block(2, 'layers.1', 2 nodes)"


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, x, *, mask):
        return {"out": self.proj(x) * mask.unsqueeze(-1), "total": x.sum()}


def test_captured_model_sizes_and_structures():
    torch.manual_seed(0)
    model = _Masked()
    x, mask = torch.randn(6, 5, 4), torch.ones(6, 5)
    captured = capture(model, (x,), {"mask": mask}, sizes="all")
    assert captured.input_names == ("x", "mask")
    assert captured.dynamic_batch and captured.captured_batch_size == 6
    batch = captured.batch_symbol
    seq = captured.values["x"].shape[1]
    assert captured.values["x"].shape == (batch, seq, 4)
    assert captured.example_sizes == {batch: 6, seq: 5}
    assert {str(k): str(v) for k, v in captured.size_names().items()} == {
        str(batch): "batch", str(seq): "x.size(1)"}
    # another call: sizes read from its inputs; sizes_at changes only the batch
    flat = captured.flatten_inputs((torch.randn(2, 9, 4),), {"mask": torch.ones(2, 9)})
    assert [tuple(t.shape) for t in flat] == [(2, 9, 4), (2, 9)]
    assert captured.sizes_of(flat) == {batch: 2, seq: 9}
    assert captured.sizes_at(3) == {batch: 3, seq: 5}
    assert captured.microbatch_size(4) == 2  # 6 samples in 4 torch.chunk pieces: 2, 2, 2
    # the graph computes the flattened outputs; unflatten rebuilds the model's dict
    outputs = captured.unflatten_outputs(list(captured.module(*flat)))
    want = model(flat[0], mask=flat[1])
    assert set(outputs) == {"out", "total"}
    torch.testing.assert_close(outputs["out"], want["out"])
    torch.testing.assert_close(outputs["total"], want["total"])


def test_the_ir_folder_names_each_of_its_modules():
    import pipecompile.ir as folder

    from tests.support.folders import unlisted

    assert unlisted(folder) == []
