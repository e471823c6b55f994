"""Imported once by the ranks' forkserver (tests/distributed/ranks.py): measures this machine's
rates into `pipecompile.default_cache` as a rank would (one thread), so that every rank forked
from the server starts with them instead of measuring them again (about 1 s of CPU and 3 s of
waiting per rank). They are what `compile` measures first in any process (the matmul rate and
the cost of one pipeline action, measure/rates.py, keyed by the device and the measurement's
settings); nothing of a model is computed or kept here, and every rank of every job gets the
same values, so two ranks of a job never plan from different measurements."""

from __future__ import annotations

import torch

import pipecompile as pc
from pipecompile.measure.rates import action_overhead, matmul_rate

_threads = torch.get_num_threads()
torch.set_num_threads(1)  # as each rank runs (ranks.py: _entry)
try:
    matmul_rate("cpu", cache=pc.default_cache)
    action_overhead("cpu", cache=pc.default_cache)
finally:
    torch.set_num_threads(_threads)
