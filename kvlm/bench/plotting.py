"""What the KV-cache benchmarks (`waste`, `invariance`, `latency`, `compare`, `kv-size --plot`) share:
the run header every JSON document carries (date, CPU, threads, torch) and small matplotlib helpers.

matplotlib is imported only inside `new_figure()`, with the non-interactive Agg backend, so the
commands run (and their tests pass) without a display, and `kvlm --help` never pays for the import.
Figures are small (about 8 x 3.2 inches at 100 dpi) so that each PNG stays well under 200 KB.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

DPI = 100


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo; `platform.processor()` is empty on most Linux systems."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_header(bench: str, model: str, threads: int) -> dict[str, Any]:
    """The fields every bench JSON starts with (read back by scripts/make_benchmarks_md.py)."""
    import torch

    return {"bench": bench, "model": str(model), "threads": threads,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu": cpu_name(),
            "torch": torch.__version__}


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
