"""Record what the README's install commands resolve to, as pip's dry-run reports, for tests/test_install.py.

README.md's two quick-start commands install torch alone from PyTorch's CPU wheel index, then kvlm
(`pip install -e .` or `-e ".[test]"`). This script runs, in a new venv in a temporary folder and with pip
set up as a bare machine has it (no config file, no PIP_* variables: PyPI plus the indexes the command
names, no local wheels or mirrors):

- `torch-step.json`: the README's torch step, `--dry-run --ignore-installed --report`, resolved against
  the CPU index alone. Where that index cannot be reached nothing is written, and the manifest says why.
- `run-step.json`, `test-step.json`: the README's kvlm steps, resolved against PyPI alone, in a venv where
  the torch step has run (with this machine's own pip settings: a local CPU wheel serves where the CPU
  index cannot be reached, and it is the same build, 2.13.0+cpu).
- `pypi-torch.json`: plain `pip install torch==2.13.0` against PyPI alone, the contrast: the CUDA build.

Each report keeps what pip wrote except the packages' long descriptions (`metadata.description`), dropped to
keep the files small, and the local checkout's path, written as `file://<checkout>`. `manifest.json` holds
the date, pip, Python, machine, each command and its outcome. Run from the repository root: `python
scripts/record_install_reports.py` (a few minutes; needs PyPI).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "install"


def readme_pip_steps() -> dict[str, list[str]]:
    """The README's quick-start pip steps: {'torch': [...], 'run': [...], 'test': [...]} as argument lists."""
    steps: dict[str, list[str]] = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        if not line.startswith("python3 -m venv "):
            continue
        for part in line.split(" && "):
            args = shlex.split(part)
            if args[:2] != ["pip", "install"]:
                continue
            if any(re.match(r"torch==", a) for a in args):
                steps["torch"] = args
            elif "-e" in args:
                steps["test" if args[args.index("-e") + 1] == ".[test]" else "run"] = args
    return steps


def _bare_env() -> dict[str, str]:
    """This process's environment without pip settings: no PIP_* variable, and no config file at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip then reads no config file (global, user or site)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _report(python: Path, args: list[str], out: Path, *, fresh: bool) -> dict:
    """Run `pip install ... --dry-run --report out` with the bare pip setup; the outcome for the manifest."""
    cmd = [str(python), "-m", *args, "--dry-run", "--quiet", "--report", str(out)]
    if fresh:
        cmd.append("--ignore-installed")  # resolve as in a new venv (this one may hold torch already)
    r = subprocess.run(cmd, cwd=ROOT, env=_bare_env(), capture_output=True, text=True, timeout=1800)
    outcome = {"command": " ".join(args), "returncode": r.returncode}
    if r.returncode != 0:
        out.unlink(missing_ok=True)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        # Why: the first network error (an unreachable index shows only as warnings), then pip's verdict.
        network = [re.sub(r"<[^>]*>", "", line)[:300] for line in lines if "Failed to establish" in line][:1]
        outcome["failure"] = network + ([line for line in lines if line.startswith("ERROR")][-2:] or lines[-2:])
        return outcome
    report = json.loads(out.read_text())
    for item in report["install"]:
        item["metadata"].pop("description", None)
        if item.get("download_info", {}).get("url", "").startswith("file://"):  # this checkout: no local path
            item["download_info"]["url"] = "file://<checkout>"
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    outcome["packages"] = len(report["install"])
    return outcome


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="A few minutes; needs PyPI.").parse_args()
    steps = readme_pip_steps()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        pip_version = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True,
                                     check=True).stdout.split()[1]
        manifest = {
            "recorded": datetime.date.today().isoformat(),
            "pip": pip_version,
            "python": platform.python_version(),
            "machine": f"{platform.system()} {platform.machine()}",
            "pip_setup": "no pip config file, no PIP_* variables: PyPI plus the indexes each command names",
            "readme_steps": {k: " ".join(v) for k, v in steps.items()},
            "reports": {},
        }
        reports = manifest["reports"]
        reports["torch-step"] = _report(python, steps["torch"], OUT / "torch-step.json", fresh=True)
        reports["pypi-torch"] = _report(python, ["pip", "install", "torch==2.13.0"], OUT / "pypi-torch.json",
                                        fresh=True)
        # The state the torch step leaves, made with this machine's own pip settings (see the docstring).
        subprocess.run([str(python), "-m", *steps["torch"], "--quiet"], check=True, cwd=ROOT)
        torch_installed = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                                         capture_output=True, text=True, check=True).stdout.strip()
        manifest["torch_installed_before_the_kvlm_steps"] = torch_installed
        for name in ("run", "test"):
            reports[f"{name}-step"] = _report(python, steps[name], OUT / f"{name}-step.json", fresh=False)
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
