""".ci/check_test_imports.py: CI fails on a module that no test of its own folder imports, and
names the folder its test belongs in."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_test_imports",
                                                  ROOT / ".ci" / "check_test_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(tmp_path, files):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg", tmp_path / "tests"


PACKAGE = {
    "pkg/__init__.py": "",
    "pkg/top.py": "",
    "pkg/other.py": "",
    "pkg/sub/__init__.py": "",
    "pkg/sub/a.py": "",
    "pkg/sub/b.py": "",
    "pkg/sub/c.py": "",
}


def test_each_module_needs_a_test_of_its_own_folder(tmp_path, capsys):
    checker = _checker()
    package, tests = _tree(tmp_path, {
        **PACKAGE,
        "tests/test_top.py": "import pkg\nimport pkg.top as t\n",
        # imported from the wrong folder: pkg.sub.b's test belongs in tests/sub/
        "tests/test_misplaced.py": "from pkg.sub.b import thing\n",
        # a helper is not a test file, even though it imports pkg.other
        "tests/helpers.py": "import pkg.other\n",
        "tests/sub/test_a.py": "def test_a():\n    from pkg.sub import a\n",
        # a string that looks like an import does not count
        "tests/sub/test_c.py": "text = 'import pkg.sub.c'\n",
    })
    assert checker.modules(package) == {
        "pkg": Path("."), "pkg.other": Path("."), "pkg.sub": Path("sub"),
        "pkg.sub.a": Path("sub"), "pkg.sub.b": Path("sub"), "pkg.sub.c": Path("sub"),
        "pkg.top": Path(".")}
    assert checker.untested(package, tests) == [
        ("pkg.other", Path(".")), ("pkg.sub.b", Path("sub")), ("pkg.sub.c", Path("sub"))]
    assert checker.main(["--package", str(package), "--tests", str(tests)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "pkg.other: imported by no tests/test_*.py; add a test there that imports it",
        "pkg.sub.b: imported by no tests/sub/test_*.py; add a test there that imports it",
        "pkg.sub.c: imported by no tests/sub/test_*.py; add a test there that imports it"]


def test_every_import_form_counts_and_then_the_check_passes(tmp_path, capsys):
    checker = _checker()
    package, tests = _tree(tmp_path, {
        **PACKAGE,
        "tests/test_top.py": "from pkg import top\nimport pkg.other\n",  # pkg itself, via from
        "tests/sub/test_x.py": "import pkg.sub.a, pkg.sub.b as b\nfrom pkg.sub.c import f\n",
    })
    # `import pkg.sub.a` names pkg.sub.a only; the subpackage needs `from pkg.sub import ...`
    # or `import pkg.sub`
    assert checker.untested(package, tests) == [("pkg.sub", Path("sub"))]
    (tests / "sub" / "test_y.py").write_text("from pkg.sub import a\n")
    assert checker.untested(package, tests) == []
    assert checker.main(["--package", str(package), "--tests", str(tests)]) == 0
    assert capsys.readouterr().out == ""


def test_a_folder_that_mirrors_no_package_folder_is_named(tmp_path, capsys):
    checker = _checker()
    package, tests = _tree(tmp_path, {
        **PACKAGE,
        "tests/test_top.py": "from pkg import top, other\n",
        "tests/sub/test_x.py": "from pkg.sub import a, b, c\n",
        "tests/sbu/test_y.py": "",  # misspelt: its tests would count for no module
        "tests/distributed/cases.py": "", "tests/integration/test_z.py": "",  # allowed on purpose
        "tests/support/helpers.py": "", "tests/ci/test_w.py": "",
    })
    assert checker.untested(package, tests) == []
    assert checker.unmirrored(package, tests) == [Path("sbu")]
    assert checker.main(["--package", str(package), "--tests", str(tests)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "tests/sbu/: mirrors no folder of pkg/; move its files into the folder they test, or "
        "into one of bench, ci, distributed, integration, support"]
    (tests / "sbu" / "test_y.py").unlink()
    (tests / "sbu").rmdir()
    assert checker.main(["--package", str(package), "--tests", str(tests)]) == 0
