"""Every relative Markdown link in README.md, docs/**/*.md and the committed model cards points at a file
or folder that exists, and every ``#anchor`` it names is a heading of the page it points at."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from snippets import ROOT, doc_files

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def pages() -> list[Path]:
    return doc_files() + sorted((ROOT / "engine" / "weights").rglob("README.md"))


def outside_fences(path: Path) -> list[str]:
    """The page's lines outside its fenced blocks."""
    out, fence = [], None
    for line in path.read_text().split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None:
            fence = None if line.strip().startswith(fence) else fence
        else:
            out.append(line)
    return out


def prose(path: Path) -> str:
    """The page without its fenced blocks and inline code (links there are not links)."""
    return "\n".join(re.sub(r"`[^`]*`", "", line) for line in outside_fences(path))


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens; repeats get -1, -2."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(text, 0)
        seen[text] = n + 1
        out.add(text if n == 0 else f"{text}-{n}")
    return out


def raw_anchors(path: Path) -> set[str]:
    """Anchors from the headings with inline code kept (the code's text is part of GitHub's anchor)."""
    out = set()
    for line in outside_fences(path):
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if h:
            out.add(re.sub(r"[^\w\- ]", "", h.group(1).lower()).replace(" ", "-"))
    return out


def broken_links(path: Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = path.relative_to(ROOT)
        if not dest.exists():
            problems.append(f"{rel}: {target} -> no such file")
            continue
        if anchor and dest.is_file() and dest.suffix == ".md" and anchor not in raw_anchors(dest) | anchors(dest):
            problems.append(f"{rel}: {target} -> no heading #{anchor} in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    problems = broken_links(path)
    assert not problems, "\n".join(problems)
