"""format_table: columns as wide as their widest cell, a header rule, indent, right-aligned
columns; the doctest in the module runs here too."""

from __future__ import annotations

import doctest

from pipecompile.outputs import table
from pipecompile.outputs.table import format_table


def test_columns_rule_indent_and_alignment():
    rows = [("stage", "device", "ms"), ("0", "cpu", "12.5"), ("10", "cuda:1", "3.0")]
    assert format_table(rows, header=True, indent=2, right=(2,)) == [
        "  stage  device    ms",
        "  -----  ------  ----",
        "  0      cpu     12.5",
        "  10     cuda:1   3.0"]
    assert format_table([("a", ""), ("bb", "")]) == ["a", "bb"]  # no trailing blanks
    assert format_table([]) == []


def test_module_doctest():
    assert doctest.testmod(table).failed == 0
