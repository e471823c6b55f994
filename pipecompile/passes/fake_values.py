"""The fake stand-ins a block is costed on (`passes.annotate`): what it reads from outside itself.

The annotate pass runs each block on fake tensors (shape, dtype and device, no data). A block
reads two kinds of outside values, and `FakeValues` makes a stand-in for each:

    module tensors   parameters and buffers: a fake of each (one fake per tensor object, so a
                     tied weight stays one). A model built on the meta device keeps meta
                     tensors, while the graph's values were traced on the device those tensors
                     claimed (`capture.claimed_device`): their fakes claim that device too, or
                     every op mixing a parameter and an input fails ("found at least two
                     devices, cpu and meta") and the block would be costed at no FLOPs.
    graph values     the captured value (`node.meta["val"]`), its sizes symbolic; or, with
                     `specialize`, the same value with every size but the batch at its example
                     value: some backward kernels take no symbolic sizes (a pad whose amounts
                     are computed from the image's height: "SymIntArrayRef expected to contain
                     only concrete integers"), and the planner only ever evaluates costs at the
                     example sizes with another batch (`CapturedModel.sizes_at`), so a cost that
                     is symbolic in the batch alone is exact for it.

`run_on_fakes` runs a block's costing on these stand-ins, most symbolic first:

    1. every captured size symbolic (costs are expressions of all of them);
    2. sizes other than the batch at the example's (expressions of the batch);
    3. every size concrete, at the example's batch b and at 2b: costs linear in the batch
       through those two points (a backward kernel that takes no symbolic strides, such as a
       pad's on a permuted input, fails even with the batch alone symbolic). FLOPs and bytes
       of every op pipecompile prices are linear in the batch (each sample computed alike).

Every run is `unguarded`: no guard is recorded in the capture's shape environment, on this
thread or in autograd's backward, so the batch stays symbolic for the rest of the compile.

`FakeValues` is made per costing (a pure function of the graph and the device): it keeps no
state between compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Callable, Iterator, Mapping, TypeVar

import sympy
import torch
import torch.fx as fx

__all__ = ["FakeValues", "fake_mode_of", "run_on_fakes", "unguarded"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def fake_mode_of(graph: fx.Graph) -> Any:
    """The fake mode the capture's values live in (a new one for a graph without fakes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if hasattr(val, "fake_mode"):
            return val.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


class FakeValues:
    """Fake stand-ins in `mode` for module tensors (claiming `device` where a tensor is on meta
    and `device` is a real one) and for captured graph values (sizes other than the batch set
    to their example values where `specialize` maps their symbols)."""

    def __init__(self, mode: Any, device: torch.device | None, *,
                 specialize: Mapping[sympy.Symbol, int] | None = None,
                 hints: Mapping[sympy.Symbol, int] | None = None,
                 estimates: Mapping[sympy.Symbol, Any] | None = None) -> None:
        self.mode = mode
        self.device = device if device is not None and device.type != "meta" else None
        self.specialize = {s: sympy.Integer(v) for s, v in (specialize or {}).items()}
        self.hints = {s: sympy.Integer(v) for s, v in (hints or {}).items()}
        self.estimates = dict(estimates or {})  # data-dependent sizes (capture/unbacked.py)
        self._made: dict[int, torch.Tensor] = {}  # id(own tensor) -> its fake (ties: one)

    def specialized(self, sizes: Mapping[sympy.Symbol, int],
                    hints: Mapping[sympy.Symbol, int]) -> "FakeValues":
        """The same stand-ins with the symbols of `sizes` set to those values; `hints` are
        the example's value of every symbol (what a size left symbolic is traced at)."""
        return FakeValues(self.mode, self.device, specialize=sizes, hints=hints,
                          estimates=self.estimates)

    def data_scalar(self, val: Any) -> int | None:
        """The estimate of a data-dependent size (`x.split(counts.tolist())`'s `u0`) where
        every size it depends on is concrete here, else None. A fake run cannot read data,
        and a new unbacked size on each run fails the first guard that compares two
        (JetMoE's routed experts); the estimate makes the block's shapes concrete."""
        if not isinstance(val, torch.SymInt) or val.node.expr not in self.estimates:
            return None
        value = sympy.sympify(self.estimates[val.node.expr]).xreplace(self.specialize)
        return int(value) if value.is_number else None

    def module_tensor(self, real: torch.Tensor) -> torch.Tensor:
        """A fake of a parameter or buffer (not yet requiring grad)."""
        if not (real.is_meta and self.device is not None):
            return self.mode.from_tensor(real.detach())
        from torch._subclasses.fake_tensor import FakeTensor

        if id(real) not in self._made:
            self._made[id(real)] = FakeTensor(self.mode, real.detach(), self.device)
        return self._made[id(real)]

    def graph_value(self, val: Any) -> Any:
        """The captured value `val` (a fake tensor, SymInt or constant), detached, with its
        sizes specialized if asked."""
        if not self.specialize:
            return val.detach() if isinstance(val, torch.Tensor) else val
        if isinstance(val, torch.SymInt):
            return self._size(val)
        if isinstance(val, torch.Tensor):
            shape = [self._size(d) for d in val.shape]
            with self.mode:
                return torch.empty(shape, dtype=val.dtype, device=val.device)
        return val

    def _size(self, size: Any) -> Any:
        if not isinstance(size, torch.SymInt):
            return size
        expr = size.node.expr.xreplace(self.specialize)
        if expr.is_number:
            return int(expr)
        return size.node.shape_env.create_symintnode(expr, hint=int(expr.xreplace(self.hints)))


def run_on_fakes(run: Callable[[FakeValues], T], fakes: FakeValues, *,
                 example_sizes: Mapping[sympy.Symbol, int], batch: sympy.Symbol | None,
                 name: str) -> T:
    """`run(stand-ins)` with every size symbolic, else with only the batch symbolic, else fitted
    through two concrete batch sizes (see the module docstring); the last failure is raised.
    `name` names the block in the log, and in a warning if its run fixed the batch symbol
    anyway (a guard recorded where `unguarded` does not reach: every later cost a constant)."""
    before = _pinned(fakes.mode, batch)
    result = _fewer_symbols(run, fakes, example_sizes, batch, name)
    after = _pinned(fakes.mode, batch)
    if before is None and after is not None:
        warnings.warn(
            f"pipecompile: costing block {name} on fake tensors fixed the batch size at "
            f"{after} (a guard on it was recorded); the costs of every later block are "
            f"constants at that batch, so time and memory are predicted for it, not for the "
            f"micro-batch: report this with the model", RuntimeWarning, stacklevel=2)
    return result


def _pinned(mode: Any, batch: sympy.Symbol | None) -> sympy.Expr | None:
    """The number the capture's shape environment replaced `batch` by, if any."""
    env = getattr(mode, "shape_env", None)
    value = env.replacements.get(batch) if env is not None and batch is not None else None
    return value if value is not None and value.is_number else None


def _fewer_symbols(run: Callable[[FakeValues], T], fakes: FakeValues,
                   example_sizes: Mapping[sympy.Symbol, int], batch: sympy.Symbol | None,
                   name: str) -> T:
    others = {s: v for s, v in example_sizes.items() if s != batch}
    try:
        with unguarded(fakes.mode):
            return run(fakes)
    except Exception as exc:  # noqa: BLE001 - tried again with fewer symbols below
        failure = exc
    if others:
        log.info("pipecompile: block %s could not run on fake tensors with every size symbolic "
                 "(%s); costing it with only the batch symbolic", name, failure)
        try:
            with unguarded(fakes.mode):
                return run(fakes.specialized(others, example_sizes))
        except Exception as exc:  # noqa: BLE001
            failure = exc
    if batch is None or batch not in example_sizes:
        raise failure
    log.info("pipecompile: block %s could not run on fake tensors with a symbolic batch (%s); "
             "costing it at two batch sizes, linear in between", name, failure)
    b1 = int(example_sizes[batch])
    b2 = 2 * b1
    first = run(fakes.specialized({**others, batch: b1}, example_sizes))
    second = run(fakes.specialized({**others, batch: b2}, example_sizes))
    return _linear(first, second, batch, b1, b2)


@contextlib.contextmanager
def unguarded(mode: Any) -> Iterator[None]:
    """Costing on `mode`'s fakes without guards: a kernel that reads a size as an int (a
    backend chosen by comparing sizes, col2im's backward for `F.unfold`) takes the example's
    branch without recording a guard, which would replace the batch symbol by the example's
    batch in the capture's shape environment (every later cost a constant at that batch).
    The suppression is thread-local, so autograd's backward is kept on this thread too: on an
    accelerator (CUDA) the engine runs a backward on its device thread, where the backward
    kernels' guards were recorded (a compile on CUDA had every cost a constant)."""
    env = getattr(mode, "shape_env", None)
    with (env.suppress_guards() if env is not None else contextlib.nullcontext()), \
            torch.autograd.set_multithreading_enabled(False):
        yield


def _linear(first: Any, second: Any, batch: sympy.Symbol, b1: int, b2: int) -> Any:
    """Every number of `first` (at batch `b1`) that differs from `second`'s (at `b2`) as the
    line through both, in `batch`: sympy numbers and plain ints and floats (a size costed at
    concrete sizes is a plain int), through tuples and dataclasses (the block's `Kernels`:
    its GEMM shapes and bytes) field by field; an equal value (a count, a flag) as it is."""
    if isinstance(first, bool) or first is None:
        return first
    if isinstance(first, (int, float)) or (isinstance(first, sympy.Basic) and first.is_number):
        if first == second:
            return first
        slope = (sympy.sympify(second) - sympy.sympify(first)) / (b2 - b1)
        return sympy.expand(sympy.sympify(first) + slope * (batch - b1))
    if isinstance(first, tuple) and isinstance(second, tuple) and len(first) == len(second):
        return tuple(_linear(a, b, batch, b1, b2) for a, b in zip(first, second))
    if (dataclasses.is_dataclass(first) and not isinstance(first, type)
            and type(first) is type(second)):
        return dataclasses.replace(first, **{
            f.name: _linear(getattr(first, f.name), getattr(second, f.name), batch, b1, b2)
            for f in dataclasses.fields(first) if f.init})
    return first
