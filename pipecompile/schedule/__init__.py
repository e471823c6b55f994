"""Schedules as plain data: actions, the schedule generators, lowering (messages from the
program's wiring), validation and the simulator. Pure: imports neither torch nor the runtime,
so a schedule can be generated, printed, checked and simulated without a model."""
