"""Fail when a module under pipecompile/ is longer than the cap (one concept per file).

Usage: python .ci/check_module_size.py [--max-lines N] [ROOT]
Prints each offending file with its line count and exits 1; prints nothing and exits 0 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MAX_LINES = 500


def oversized(root: Path, max_lines: int) -> list[tuple[Path, int]]:
    """(path, lines) of every .py file under `root` with more than `max_lines` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            found.append((path, lines))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(Path(__file__).resolve().parents[1]
                                                       / "pipecompile"))
    parser.add_argument("--max-lines", type=int, default=MAX_LINES)
    args = parser.parse_args(argv)
    found = oversized(Path(args.root), args.max_lines)
    root = Path(args.root).resolve()
    for path, lines in found:
        shown = path.resolve().relative_to(root.parent)
        print(f"{shown}: {lines} lines, more than {args.max_lines}; split it into modules "
              f"of one concept each")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
