"""Fail when a module under pipecompile/ is imported by no test of its own folder (tests mirror
the package).

A module `pipecompile/runtime/foo.py` needs a `tests/runtime/test_*.py` that imports it; a
top-level `pipecompile/foo.py` needs a `tests/test_*.py`; a subpackage's `__init__.py` counts as
the subpackage (`pipecompile/runtime/__init__.py` is `pipecompile.runtime`, tested from
`tests/runtime/`, the package's own from `tests/`). Imports are read statically with `ast`,
anywhere in a test file (also inside a test function):

    import pipecompile.runtime.foo              # pipecompile.runtime.foo
    from pipecompile.runtime.foo import bar     # pipecompile.runtime.foo
    from pipecompile.runtime import foo         # pipecompile.runtime.foo and pipecompile.runtime

Only the named module counts: `import pipecompile.runtime.foo` does not count for
`pipecompile.runtime`, nor does a test that reaches a module through another one.

A folder of tests/ mirrors a folder of the package, or is one of `OTHER_FOLDERS` (tests that
belong to no single folder: the bench scripts' checks, multi-rank jobs, whole-model runs, the
CI checks, and the helpers they share); any other folder is reported, so that a misspelt tests/runtme/ is not read past.

Usage: python .ci/check_test_imports.py [--package DIR] [--tests DIR]
Prints each module imported by no test of its folder, with the folder its test belongs in, and
each folder of tests/ that mirrors none of the package, and exits 1; prints nothing and exits 0
otherwise.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# folders of tests/ that mirror no package folder on purpose (see the module docstring)
OTHER_FOLDERS = ("bench", "ci", "distributed", "integration", "support")


def modules(package: Path) -> dict[str, Path]:
    """Dotted name -> the test folder (relative to the tests root) of every module in `package`.

    `pkg/__init__.py` is `pkg`, `pkg/sub/__init__.py` is `pkg.sub` (folder `sub`), `pkg/sub/x.py`
    is `pkg.sub.x` (folder `sub`)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        folder = Path(*parts[:-1])
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package.name, *parts))] = folder
    return found


def imported(test_file: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `test_file` names in an import statement."""
    tree = ast.parse(test_file.read_text(encoding="utf-8"), str(test_file))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names & known


def untested(package: Path, tests: Path) -> list[tuple[str, Path]]:
    """(module, test folder) of every module that no `test_*.py` directly in that folder of
    `tests` imports, in the order of `modules`."""
    owners = modules(package)
    covered: dict[Path, set[str]] = {}
    for folder in set(owners.values()):
        names: set[str] = set()
        for test_file in sorted((tests / folder).glob("test_*.py")):
            names |= imported(test_file, set(owners))
        covered[folder] = names
    return [(name, folder) for name, folder in owners.items() if name not in covered[folder]]


def unmirrored(package: Path, tests: Path) -> list[Path]:
    """The folders of `tests` (relative to it) holding Python files that mirror no folder of
    `package` and lie outside `OTHER_FOLDERS`, sorted."""
    mirrored = set(modules(package).values())
    found = set()
    for path in tests.rglob("*.py"):
        folder = path.parent.relative_to(tests)
        if folder in mirrored or (folder.parts and folder.parts[0] in OTHER_FOLDERS):
            continue
        found.add(folder)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default=str(ROOT / "pipecompile"))
    parser.add_argument("--tests", default=str(ROOT / "tests"))
    args = parser.parse_args(argv)
    tests = Path(args.tests)
    found = untested(Path(args.package), tests)
    for name, folder in found:
        where = (Path(tests.name) / folder).as_posix()
        print(f"{name}: imported by no {where}/test_*.py; add a test there that imports it")
    stray = unmirrored(Path(args.package), tests)
    for folder in stray:
        where = (Path(tests.name) / folder).as_posix()
        print(f"{where}/: mirrors no folder of {Path(args.package).name}/; move its files into "
              f"the folder they test, or into one of {', '.join(OTHER_FOLDERS)}")
    return 1 if found or stray else 0


if __name__ == "__main__":
    sys.exit(main())
