"""runtime/data_parallel.py's parts on their own (tests/runtime/test_distributed.py and
test_fsdp.py train whole pipelines; test_distributed_setup.py runs the mesh check and a
replicated stage's reduction on gloo ranks): when torch's hooks may reduce during backward, and
the once-per-step arming of a sharded stage."""

from __future__ import annotations

from pipecompile.runtime import data_parallel
from pipecompile.schedule.schedules import make_schedule


def test_hooks_reduce_in_backward_only_for_one_plain_backward_per_microbatch():
    gpipe, zb = make_schedule("gpipe", 2, 4), make_schedule("zb-h1", 2, 4)
    assert data_parallel.reduces_in_backward(gpipe, checkpoint=False, compiled=False)
    assert data_parallel.reduces_in_backward(make_schedule("1f1b", 2, 4), False, False)
    assert not data_parallel.reduces_in_backward(zb, False, False)  # W bypasses the hooks
    assert not data_parallel.reduces_in_backward(gpipe, checkpoint=True, compiled=False)
    assert not data_parallel.reduces_in_backward(gpipe, checkpoint=False, compiled=True)


class _Sharded:
    """Records the FSDP2 switches `MicrobatchSync` sets on a stage."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda value: self.calls.append((name, value))


def test_a_sharded_stage_syncs_and_reshards_at_the_steps_last_backward_only():
    module = _Sharded()
    sync = data_parallel.MicrobatchSync(module, microbatches=3, replicas=2)
    for _ in range(2):  # two steps: the counter starts again
        sync.begin_step()
        module.calls.clear()
        for _ in range(3):
            sync.before_backward()
        assert module.calls == [
            (name, last) for last in (False, False, True)
            for name in ("set_is_last_backward", "set_requires_gradient_sync",
                         "set_reshard_after_backward")]
    module.calls.clear()
    sync.summed(False)  # FSDP's own mean: nothing to set
    assert module.calls == []
    sync.summed(True)  # summed over replicas: divide by 1
    sync.summed(True)  # unchanged: not set again
    sync.summed(False)  # back to the mean over 2 replicas
    assert module.calls == [("set_gradient_divide_factor", 1.0),
                            ("set_gradient_divide_factor", 2.0)]
