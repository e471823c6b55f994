"""Runtime: schedules as data and the executors that interpret them."""
