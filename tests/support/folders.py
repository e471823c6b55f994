"""Each folder of the package names every module it holds in its docstring (the map a newcomer
reads first)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def unlisted(package: ModuleType) -> list[str]:
    """The modules of `package`'s folder its docstring does not name as `name.py`."""
    folder = Path(package.__file__).parent
    text = package.__doc__ or ""
    return sorted(p.name for p in folder.glob("*.py")
                  if p.name != "__init__.py" and p.name not in text)
