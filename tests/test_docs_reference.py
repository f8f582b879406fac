"""The docs stay a reference: short sections, and every link into them lands on a heading.

(a) No `##` section of docs/memory-model.md or docs/layouts-evidence.md is over 300 lines (a
section runs from its `##` heading to the next `##` or `#` heading). (b) Every `docs/<name>.md#<anchor>` reference in the
repository's Python, Markdown, text and JSON files, every `<name>.md#<anchor>` link between docs
and every `](#anchor)` link inside a doc names an anchor the target file defines: a heading's
GitHub slug or an explicit `<a id="...">`.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
while not (ROOT / "pyproject.toml").exists():
    ROOT = ROOT.parent
DOCS = ROOT / "docs"
MAX_SECTION_LINES = 300
SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "node_modules", "__pycache__",
             ".pytest_cache", ".ruff_cache", ".hypothesis", ".benchmarks"}
SCANNED = {".py", ".md", ".txt", ".json"}

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HTML_ANCHOR = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
_DOC_REF = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*)([\w-]+\.md)#([\w-]+)")
_LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")


def _markdown_lines(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a code fence) for every line of `path`."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            out.append((n, line, True))
            continue
        out.append((n, line, fenced))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading text: link targets kept, markup and punctuation dropped,
    lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    out = []
    for ch in text.strip().lower():
        if ch == " ":
            out.append("-")
        elif ch in "-_" or unicodedata.category(ch)[0] in "LN":
            out.append(ch)
    return "".join(out)


def anchors(path: Path) -> set[str]:
    """Every anchor `path` defines: heading slugs (GitHub's -1, -2 for repeats) and <a id>."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line, fenced in _markdown_lines(path):
        if fenced:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            found.add(base if k == 0 else f"{base}-{k}")
    return found


def sections(path: Path) -> list[tuple[str, int]]:
    """(heading, length in lines) of every `##` section of `path`."""
    out, start, title = [], None, None
    lines = _markdown_lines(path)
    for n, line, fenced in lines + [(len(lines) + 1, "# end", False)]:
        m = None if fenced else _HEADING.match(line)
        if m and len(m.group(1)) <= 2:
            if title is not None:
                out.append((title, n - start))
            title, start = (m.group(2), n) if len(m.group(1)) == 2 else (None, None)
    return out


def _scanned_files() -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        out.extend(Path(folder) / f for f in sorted(files) if Path(f).suffix in SCANNED)
    return out


def references() -> list[tuple[str, Path, str]]:
    """(where, target doc, anchor) for every anchored reference to a file of docs/."""
    out = []
    doc_names = {p.name for p in DOCS.glob("*.md")}
    for path in _scanned_files():
        rel = path.relative_to(ROOT)
        in_docs = rel.parts[0] == "docs" and path.suffix == ".md"
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace")
                                 .splitlines(), 1):
            where = f"{rel}:{n}"
            for prefix, name, anchor in _DOC_REF.findall(line):
                if prefix.rstrip("/").endswith("docs") or (in_docs and not prefix):
                    out.append((where, DOCS / name, anchor))
                elif not prefix and name in doc_names:
                    out.append((where, DOCS / name, anchor))
            if path.suffix == ".md":
                for anchor in _LOCAL_LINK.findall(line):
                    out.append((where, path, anchor))
    return out


def test_slug_follows_github():
    assert slug("Expert parallelism (MoE)") == "expert-parallelism-moe"
    assert slug("Boundaries (`retained`, full recompute)") == "boundaries-retained-full-recompute"
    assert slug("Pipeline stages (PP > 1)") == "pipeline-stages-pp--1"
    assert slug("A [link](x.md) here") == "a-link-here"


def test_sections_are_measured_to_the_next_level_two_heading(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("# T\n\n## A\n1\n2\n### A.1\n3\n## B\n```\n## not a heading\n```\n")
    assert sections(doc) == [("A", 5), ("B", 4)]
    assert anchors(doc) == {"t", "a", "a1", "b"}


@pytest.mark.parametrize("name", ["memory-model.md", "layouts-evidence.md"])
def test_no_level_two_section_over_300_lines(name):
    long = [f"{title!r}: {n} lines" for title, n in sections(DOCS / name)
            if n > MAX_SECTION_LINES]
    assert not long, f"docs/{name} sections over {MAX_SECTION_LINES} lines: {long}"


def test_every_docs_anchor_reference_exists():
    refs = references()
    assert len(refs) > 100  # the scan sees the code's and the docs' references
    cache: dict[Path, set[str]] = {}
    broken = []
    for where, target, anchor in refs:
        if not target.exists():
            broken.append(f"{where}: {target.relative_to(ROOT)} does not exist")
            continue
        if target not in cache:
            cache[target] = anchors(target)
        if anchor not in cache[target]:
            broken.append(f"{where}: {target.relative_to(ROOT)}#{anchor}")
    assert not broken, "anchors that no heading or <a id> defines:\n" + "\n".join(broken)
