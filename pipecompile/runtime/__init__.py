"""Runtime: stage workers, transports, and the executor that runs each device's generated step."""
