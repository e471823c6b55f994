"""Capture: a model and example inputs -> one flat fx graph (`CapturedModel`).

    capture.py         `capture(model, args, kwargs)`: torch.export (default) or fx, opaque blocks
    export.py          the torch.export front end: attempts bounded in time, what failures make opaque
    graph.py           the captured graph's values, size symbols and their ranges
    blame.py           why a capture failed: the module and line of the model's own code
    opaque.py          modules kept whole (one graph node) where export cannot trace them
    opaque_causes.py   what makes a module opaque: custom autograd Functions, `.data` writes
    unbacked.py        an estimate for each data-dependent size (a split's: an even split)
    claimed_device.py  a meta model traced on fakes that claim the device it will train on
    bounded.py         whether a call finishes within a budget, found in a child process
    inputs.py          a call's inputs checked against what the model was compiled with
    quiet.py           torch's output of a failing export kept off the terminal, for one thread
    fingerprint.py     everything a capture depends on, as one key (None: the model cannot be keyed)
    reuse.py           a kept capture rebound to a structurally identical model's own tensors
"""
