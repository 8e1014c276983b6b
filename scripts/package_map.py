#!/usr/bin/env python3
"""Print ARCHITECTURE.md's package map from the tree: every package of kvlm, then each module with the
first sentence of its docstring. ARCHITECTURE.md holds the output between `<!-- package-map -->` markers
and tests/test_layout.py checks that it is current:

    python scripts/package_map.py            # print the table
    python scripts/package_map.py --write    # rewrite the block in ARCHITECTURE.md
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- package-map -->", "<!-- /package-map -->"


def summary(path: Path) -> str:
    """The docstring's first sentence (up to the first '. ' or the end of its first paragraph)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    para = " ".join(doc.split("\n\n")[0].split())
    m = re.match(r"(.+?\.)(\s|$)", para)
    return (m.group(1) if m else para).rstrip(".").replace("|", "\\|")


def package_map(root: Path = ROOT / "kvlm") -> str:
    rows = ["| module | holds |", "|---|---|"]
    packages = sorted([root] + [p for p in root.iterdir() if (p / "__init__.py").is_file()],
                      key=lambda p: (p != root, p.name))
    for pkg in packages:
        name = "kvlm" if pkg == root else f"kvlm/{pkg.name}"
        rows.append(f"| **`{name}/`** | {summary(pkg / '__init__.py')} |")
        for mod in sorted(pkg.glob("*.py")):
            if mod.name in ("__init__.py", "__main__.py"):
                continue
            rows.append(f"| `{mod.name}` | {summary(mod)} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the block in ARCHITECTURE.md")
    args = ap.parse_args()
    table = package_map()
    if not args.write:
        print(table)
        return 0
    arch = ROOT / "ARCHITECTURE.md"
    text = arch.read_text()
    if BEGIN not in text or END not in text:
        print(f"ARCHITECTURE.md has no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    arch.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
