"""Every measurement the planner makes on this machine: blocks timed alone (`profile`), stages
timed as the runtime runs them (`stages`), the planning probe (`probe`), the machine's rates
(`rates`), the agreement of ranks (`ranks`), all reading time through clock.py (a kernel by
torch.utils.benchmark, one call by CUDA events or the wall clock). The compiler calls them;
the pure passes only read what they measured."""
