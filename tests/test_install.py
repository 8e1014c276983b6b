"""The README's install commands give a CPU build of torch because they say so: torch alone, first, from
PyTorch's CPU wheel index; `.ci/run` runs the same steps; and what pip resolves them to holds no
nvidia / CUDA / triton package.

What pip resolves to is read from dry-run reports in tests/data/install/, recorded by
`python scripts/record_install_reports.py` (its docstring says how: a new venv, pip with no config file and
no PIP_* variables, so PyPI plus the indexes each command names and no local wheel) on the date and with the
pip that `manifest.json` gives. The first recording (2026-12-01, pip 23.2.1, Python 3.11.7, Linux x86_64)
was made on a machine that reaches PyPI but not download.pytorch.org: so the kvlm steps (`pip install -e .`
and `-e ".[test]"` where the torch step has run) are recorded against PyPI alone, and so is PyPI's plain
`torch==2.13.0` (the contrast: the CUDA build, which shows the check can see one), but the torch step itself
could not be resolved against the CPU index; a rerun on 2026-12-03 (pip 23.2.1, the same machine kind) met
the same wall (download.pytorch.org does not resolve there) and refreshed the other reports. Until a run of
the script on a machine that reaches the index records `torch-step.json`, that test checks, in CI, the
environment `.ci/run` has just built with the README's steps (torch from the CPU index: the +cpu build and
no nvidia / CUDA / triton distribution installed), and elsewhere skips, saying so. Offline: the tests only
read the files and the installed distributions' metadata.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from deps import in_ci

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "install"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA = re.compile(r"^(nvidia-|cuda-|cuda_|triton)", re.IGNORECASE)


def _recorder():
    spec = importlib.util.spec_from_file_location("record_install_reports", ROOT / "scripts" /
                                                  "record_install_reports.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _manifest() -> dict:
    return json.loads((DATA / "manifest.json").read_text())


def _cuda_packages(report: dict) -> list[str]:
    return sorted(item["metadata"]["name"] for item in report["install"] if CUDA.match(item["metadata"]["name"]))


def _report(name: str) -> dict:
    report = json.loads((DATA / f"{name}.json").read_text())
    env = report["environment"]
    assert (env["sys_platform"], env["platform_machine"]) == ("linux", "x86_64"), env  # where PyPI's is CUDA
    return report


def test_readme_installs_torch_alone_from_the_cpu_index_first() -> None:
    """Both quick-start commands: the torch step (pinned, `--index-url` the CPU index: nothing from PyPI,
    so the CPU build or a failure) comes before kvlm's, which does not name torch; `.ci/run` runs the same."""
    readme = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("python3 -m venv ")]
    assert len(readme) == 2, readme
    steps = _recorder().readme_pip_steps()
    torch_step = " ".join(steps["torch"])
    assert f"--index-url {CPU_INDEX}" in torch_step and "torch==2.13.0" in steps["torch"], torch_step
    for line, kvlm in zip(readme, ("run", "test"), strict=True):
        parts = line.split(" && ")
        assert parts.index(torch_step) < parts.index(" ".join(steps[kvlm]).replace(".[test]", '".[test]"')), line
        assert not any(a.startswith("torch") for a in steps[kvlm]), steps[kvlm]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index(torch_step) < ci.index('pip install -e ".[test]"') < ci.index("python -m pytest -q")


def test_the_recording_is_of_todays_readme() -> None:
    """The reports are of the commands the README gives now: after changing them, run the recorder again."""
    now = {k: " ".join(v) for k, v in _recorder().readme_pip_steps().items()}
    assert _manifest()["readme_steps"] == now, "stale: run python scripts/record_install_reports.py"


@pytest.mark.parametrize("step", ["run", "test"])
def test_the_kvlm_step_adds_no_cuda_package(step: str) -> None:
    """After the torch step, `pip install -e .` / `-e ".[test]"` against PyPI leaves torch as it is (no
    dependency asks for another) and brings no nvidia / CUDA / triton package."""
    assert _manifest()["torch_installed_before_the_kvlm_steps"].endswith("+cpu")
    report = _report(f"{step}-step")
    names = {item["metadata"]["name"].lower() for item in report["install"]}
    assert "kvlm" in names and "torch" not in names, sorted(names)
    assert _cuda_packages(report) == []


def test_pypis_own_torch_is_the_cuda_build() -> None:
    """The contrast, and proof the check sees CUDA packages: PyPI's torch==2.13.0 for Linux x86-64 pulls them."""
    report = _report("pypi-torch")
    assert {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}["torch"] == "2.13.0"
    assert len(_cuda_packages(report)) >= 10, _cuda_packages(report)


def test_the_torch_step_adds_no_cuda_package() -> None:
    """The README's torch step against the CPU index alone: torch 2.13.0+cpu and no nvidia / CUDA / triton."""
    if not (DATA / "torch-step.json").exists():
        if in_ci():  # .ci/run has just run the README's steps in this environment: check what they installed
            import importlib.metadata

            import torch

            assert torch.__version__ == "2.13.0+cpu", torch.__version__
            names = sorted({d.metadata["Name"] for d in importlib.metadata.distributions()})
            assert [n for n in names if CUDA.match(n)] == [], names
            return
        failure = " ".join(_manifest()["reports"]["torch-step"].get("failure", ["no failure recorded"]))
        why = failure[failure.find("Failed to establish"):][:120] if "Failed to establish" in failure else failure
        pytest.skip(f"not recorded: on {_manifest()['recorded']} the recording machine could not reach {CPU_INDEX} "
                    f"({why}); run scripts/record_install_reports.py where it can")
    report = _report("torch-step")
    versions = {item["metadata"]["name"]: item["metadata"]["version"] for item in report["install"]}
    assert versions["torch"] == "2.13.0+cpu", versions
    assert all(item["download_info"]["url"].startswith("https://download.pytorch.org/") for item in report["install"])
    assert _cuda_packages(report) == []
