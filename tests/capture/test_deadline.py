"""deadline.py: a call stopped at its deadline, in the main thread or any other, with its
cleanup run; a call that finishes in time is untouched and leaves nothing behind."""

from __future__ import annotations

import threading
import time

import pytest

from pipecompile.capture.deadline import Expired, TimeUp, within


def _spin(cleaned: list) -> None:
    try:
        while True:  # pure Python, as sympy's simplification loops are
            pass
    finally:
        cleaned.append(True)


def test_a_call_past_its_deadline_is_stopped_with_its_cleanup_run():
    cleaned: list = []
    start = time.monotonic()
    with pytest.raises(TimeUp, match="did not finish within 0.2 s") as info:
        within(0.2, lambda: _spin(cleaned))
    assert 0.2 <= time.monotonic() - start < 5
    assert cleaned == [True] and info.value.seconds == 0.2
    assert isinstance(info.value.__cause__, Expired)


def test_a_call_in_another_thread_is_stopped_too():
    got: dict = {}

    def run():
        try:
            within(0.2, lambda: _spin([]))
        except TimeUp as up:
            got["stopped"] = up.seconds

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and got == {"stopped": 0.2}


def test_a_swallowed_stop_is_raised_again():
    caught = []

    def stubborn():
        while True:
            try:
                while True:
                    pass
            except Expired:
                caught.append(True)
                if len(caught) == 2:
                    raise

    with pytest.raises(TimeUp):
        within(0.1, stubborn)
    assert caught == [True, True]


def test_a_call_in_time_returns_its_value_or_its_error_and_nothing_fires_later():
    assert within(5, lambda: 42) == 42
    with pytest.raises(KeyError):
        within(5, lambda: {}["missing"])
    time.sleep(0.3)  # a watchdog left running would raise here: none is
    assert within(0.05, lambda: sum(range(10))) == 45
    time.sleep(0.3)
