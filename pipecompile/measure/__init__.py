"""Every measurement the planner makes on this machine: blocks timed alone (`profile`), stages
timed as the runtime runs them (`stages`), the planning probe (`probe`) and the machine's rates
(`rates`). The compiler calls them; the pure passes only read what they measured."""
