"""Every `*.py` path that docs/ and the package's docstrings name is a file that exists.

A path resolves against the repository root, `pipecompile/`, or the folder of the file that names
it (a docstring in `pipecompile/planner/` may say `plan.py`); docs/ may also name a module by its
bare name when exactly one module of the package or one test file has it. Names that are not this project's files
(a user's script in an example, a file the library writes, torch's own modules) are listed in
`NOT_OURS` with where they come from.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipecompile"
PATH = re.compile(r"(?<![\w./-])((?:\w+/)*\w+\.py)\b")

NOT_OURS = {
    "my_model.py",  # a user's script, in an example command line
    "FILE.py",  # the CLI's placeholder for the user's script
    "stage0.py",  # written by pipe.save()
    "stageN.py",  # written by pipe.save(), one per stage
    "loss_ctc.py",  # transformers' CTC loss, named in a capture error's example
    "stage.py",  # torch.distributed.pipelining's own module
    "transformers/utils/generic.py",  # a transformers file named in a traceback example
    # Megatron-LM's (and the Zero Bubble paper's fork's) modules, cited as a price's source
    "megatron/optimizer/optimizer.py",
    "core/pipeline_parallel/p2p_communication.py",
    "zb_schedules.py",
}


def named_paths(text: str) -> list[str]:
    return [m.group(1) for m in PATH.finditer(text)]


def resolves(name: str, where: Path, *, bare_anywhere: bool) -> bool:
    if name in NOT_OURS:
        return True
    if any((base / name).is_file() for base in (ROOT, PACKAGE, where.parent)):
        return True
    return bare_anywhere and "/" not in name and len(
        [*PACKAGE.rglob(name), *(ROOT / "tests").rglob(name)]) == 1


def docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [doc for node in ast.walk(tree) if isinstance(node, kinds)
            if (doc := ast.get_docstring(node))]


def missing() -> list[str]:
    found = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for name in named_paths(doc.read_text(encoding="utf-8")):
            if not resolves(name, doc, bare_anywhere=True):
                found.append(f"{doc.relative_to(ROOT)}: {name}")
    for module in sorted(PACKAGE.rglob("*.py")):
        for text in docstrings(module):
            for name in named_paths(text):
                if not resolves(name, module, bare_anywhere=False):
                    found.append(f"{module.relative_to(ROOT)}: {name}")
    return found


def test_the_pattern_finds_paths_and_bare_names():
    assert named_paths("see planner/plan.py and `compiler.py`, not x.pyc") == [
        "planner/plan.py", "compiler.py"]


def test_a_missing_file_is_reported_and_an_existing_one_is_not(tmp_path):
    here = PACKAGE / "planner" / "plan.py"
    assert resolves("plan.py", here, bare_anywhere=False)
    assert resolves("passes/split.py", here, bare_anywhere=False)
    assert not resolves("planner/kernels.py", here, bare_anywhere=False)
    assert not resolves("kernels.py", here, bare_anywhere=False)  # not in planner/
    assert resolves("kernels.py", ROOT / "docs" / "x.md", bare_anywhere=True)


def test_every_py_path_named_in_docs_and_docstrings_exists():
    assert missing() == []
