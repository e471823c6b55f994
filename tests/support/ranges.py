"""The profiler range a recorded operator ran under (tests of the runtime's `PP:` ranges)."""

from __future__ import annotations


def pp_range(event):
    """The `PP:` range an event ran under (its nearest such ancestor), or None."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("PP:"):
        parent = parent.cpu_parent
    return None if parent is None else parent.name
