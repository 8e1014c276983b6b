"""The README is a front door: short, the quick start first, every other page listed; no link anywhere in
the README or docs/ points at a file that is not there (the reference sections moved to docs/ pages)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_starts_with_the_quick_start() -> None:
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)
    heads = {ln: i for i, ln in enumerate(lines, 1) if ln.startswith("## ")}
    after_quick_start = min(i for ln, i in heads.items() if i > heads["## Quick start"])
    assert after_quick_start <= 121, heads  # the whole quick start within the first 120 lines
    assert [ln for ln in lines[:30] if ln.startswith("python3 -m venv ")], "the two fresh-machine commands come first"


def test_the_readme_lists_every_docs_page() -> None:
    listed = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README.split("## Documentation")[1]))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= listed, sorted(pages - listed)


def test_every_relative_link_resolves() -> None:
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: no {target}"
