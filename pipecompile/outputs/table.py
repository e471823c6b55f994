"""Plain-text tables: the one formatter behind every table pipecompile prints (the stage table,
the search's candidates and layouts, memory per device, the CLI's boundary tensors).

    >>> print("\\n".join(format_table([("name", "bytes"), ("h", "16 B"), ("skip", "2 KiB")],
    ...                               header=True, right=(1,))))
    name  bytes
    ----  -----
    h      16 B
    skip  2 KiB

Columns are as wide as their widest cell and separated by two spaces; trailing blanks are cut.
"""

from __future__ import annotations

from typing import Collection, Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[Sequence[str]], *, header: bool = False, indent: int = 0,
                 right: Collection[int] = ()) -> list[str]:
    """The lines of a table of `rows` (strings). `header`: a rule of dashes under the first
    row; `indent`: spaces before each line; `right`: the columns aligned to the right."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    pad = " " * indent

    def line(row: Sequence[str]) -> str:
        return (pad + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                for i, (c, w) in enumerate(zip(row, widths)))).rstrip()

    lines = [line(row) for row in rows]
    if header:
        lines.insert(1, pad + "  ".join("-" * w for w in widths))
    return lines
