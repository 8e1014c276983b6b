"""The figures of the benchmarks' `--plot` (and `kvlm kv-size --plot`): a small matplotlib figure, its
PNG, and `fmt_bytes` for the tables beside them. The run header and the rest of what the benchmarks
share live in `common.py`.

matplotlib is imported only inside `new_figure()`, with the non-interactive Agg backend, so the
commands run (and their tests pass) without a display, and `kvlm --help` never pays for the import.
Figures are small (about 8 x 3.2 inches at 100 dpi) so that each PNG stays well under 200 KB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DPI = 100


def new_figure(ncols: int = 1, width: float = 8.0, height: float = 3.2) -> tuple[Any, Any]:
    """(figure, axes) with the Agg backend; axes is a list when ncols > 1."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=DPI, squeeze=False)
    return fig, list(axes[0]) if ncols > 1 else axes[0][0]


def save_figure(fig: Any, path: str | Path) -> str:
    """Write the PNG (creating its folder) and close the figure; returns the path written."""
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(p, dpi=DPI, format="png")
    plt.close(fig)
    return str(p)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': binary units, for tables."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
