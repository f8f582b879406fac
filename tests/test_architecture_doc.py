"""docs/architecture.md names every module of the three rooms (a module it does not name is a
module a new maintainer cannot place)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def _module_files() -> list[Path]:
    return sorted(p for folder in ("pricing", "search", "planner")
                  for p in (ROOT / folder).rglob("*.py"))


def test_every_module_file_is_named():
    text = DOC.read_text()
    missing = []
    for path in _module_files():
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py":
            # a package's __init__ is named by its folder: `pricing/__init__.py`, or from the
            # planner's table `integrations/__init__.py`
            named = f"`{rel.as_posix()}`" in text or f"`{rel.relative_to(rel.parts[0]).as_posix()}`" in text
        elif len(rel.parts) > 2 and rel.parts[1] in ("layers",):
            named = f"`{rel.relative_to(rel.parts[0]).as_posix()}`" in text
        else:
            named = f"`{path.name}`" in text
        if not named:
            missing.append(rel.as_posix())
    assert missing == [], f"docs/architecture.md does not name: {missing}"


def test_the_check_sees_every_room():
    names = {p.relative_to(ROOT).parts[0] for p in _module_files()}
    assert names == {"pricing", "search", "planner"}
    assert len(_module_files()) > 90
