"""The number formats every report uses."""

from __future__ import annotations

from pipecompile.ir.formats import format_bytes, format_count, format_stages


def test_long_stage_lists_are_summarised_as_runs():
    assert format_stages([0, 2, 3]) == "[0, 2, 3]"
    assert format_stages([*range(27), 28, 30, 31]) == "[0-26, 28, 30-31]"


def test_counts_take_a_unit_prefix():
    assert format_count(1234.0) == "1.23k"
    assert format_count(5.0e9) == "5.00G"


def test_bytes_round_up_so_a_requirement_is_never_understated():
    assert (format_bytes(4096), format_bytes(2**30 + 1), format_bytes(100)) == (
        "4.00 KiB", "1.01 GiB", "100 B")
