"""Schedules as plain data: actions, the schedule generators, lowering (messages from the
program's wiring), validation, the simulator and a lower bound of its makespan found without
simulating (bounds.py, for the planning search). Pure: imports neither torch nor the runtime,
so a schedule can be generated, printed, checked and simulated without a model."""
