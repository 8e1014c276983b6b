"""The NEON int8 kernels on the x86 kernels' contract, bit for bit, under user-mode emulation.

No ARM machine runs this suite, so `tests/kernels/arm/contract_test.cpp` (every int8 format, M = 1, 2, 3, 8,
64, weight-group and row tails, split column ranges, against a scalar reference of the contract) is cross-compiled
from the extension's own unit sources (`isa_neon.cpp`: smull + sadalp; `isa_neon_dotprod.cpp`: sdot, built for
armv8.2-a+dotprod; `isa_neon_i8mm.cpp`: smmla 2 x 2 tiles) and run under `qemu-aarch64 -cpu max`; each binary
also checks the portable unit. The same
program built natively checks the x86 units this CPU runs. Needs Debian's `g++-aarch64-linux-gnu` and
`qemu-user` (.ci/run installs them): skipped without them, a failure under CI=true.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.deps import in_ci

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvlm" / "kernels" / "csrc"
PROGRAM = Path(__file__).parent / "arm" / "contract_test.cpp"
CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
FLAGS = ["-O3", "-std=c++20", "-fno-math-errno", "-Wno-psabi", "-Wall", "-Werror", f"-I{CSRC}"]

# (unit, its source, -march for the cross build)
# (the i8mm unit sets its own target pragma, so it is built for the base armv8.2-a as the extension builds it;
# qemu's `-cpu max` has sdot and i8mm, so the smmla tiles really run)
ARM_UNITS = [("neon", "isa_neon.cpp", "armv8-a"), ("neon_dotprod", "isa_neon_dotprod.cpp", "armv8.2-a+dotprod"),
             ("neon_i8mm", "isa_neon_i8mm.cpp", "armv8.2-a")]


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        msg = f"{tool} is not installed (Debian: apt install g++-aarch64-linux-gnu qemu-user)"
        if in_ci():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return path


def _build(cxx: str, unit: str, source: str, extra: list[str], out: Path) -> None:
    cmd = [cxx, *FLAGS, *extra, f"-DUNIT_FN=kvlm_kernels_{unit}", f'-DUNIT_NAME="{unit}"', str(PROGRAM),
           str(CSRC / source), str(CSRC / "isa_scalar.cpp"), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"build failed: {' '.join(cmd)}\n{done.stderr[-4000:]}"


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("OK"), (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.parametrize(("unit", "source", "march"), ARM_UNITS, ids=[u[0] for u in ARM_UNITS])
def test_neon_int8_kernels_are_the_contract_under_qemu(unit: str, source: str, march: str, tmp_path: Path) -> None:
    """The NEON unit's quantize_act and gemv_i8 (and the portable unit's, on aarch64) give the contract's
    bits for every format and shape, whole and split over column ranges."""
    cxx, qemu = _need(CROSS), _need(QEMU)
    exe = tmp_path / f"contract_{unit}"
    _build(cxx, unit, source, [f"-march={march}"], exe)
    if unit == "neon_i8mm":  # the tiles are compiled to smmla, not folded into another path
        objdump = shutil.which("aarch64-linux-gnu-objdump")
        if objdump is not None:
            asm = subprocess.run([objdump, "-d", str(exe)], capture_output=True, text=True, timeout=300, check=False)
            assert "smmla" in asm.stdout, "the i8mm unit has no smmla instruction"
    out = _run([qemu, "-cpu", "max", "-L", SYSROOT, str(exe), "quick"])
    assert out.count("checks") == 8, out


def test_x86_int8_kernels_are_the_contract_natively(tmp_path: Path) -> None:
    """The same program, native: the AVX2 unit (where this CPU has it) and the portable unit."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"x86 units; this is {platform.machine()}")
    from kvlm.kernels import native

    cxx = _need("g++")
    exe = tmp_path / "contract_avx2"
    _build(cxx, "avx2", "isa_avx2.cpp", [], exe)
    if native.available() and not native.isa_available("avx2"):
        pytest.skip("this CPU lacks AVX2 (the program was built; the portable unit runs in the qemu tests)")
    out = _run([str(exe), "quick"])
    assert out.count("checks") == 8, out


def test_extension_sources_compile_for_aarch64() -> None:
    """Every extension source (ops, drivers, argmax, ...) compiles for aarch64 with torch's headers (syntax only:
    no aarch64 torch to link here), so the extension builds on ARM, not only the kernel units above."""
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils import cpp_extension

    from kvlm.kernels import native

    cxx = _need(CROSS)
    includes = [f"-I{p}" for p in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(CSRC))]

    def check(source: str) -> subprocess.CompletedProcess[str]:
        cmd = [cxx, "-std=c++20", "-fopenmp", "-fsyntax-only", "-Wno-psabi", *includes, str(CSRC / source)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)

    # one compiler per core (each source parses torch's headers: ~5 s apiece)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for source, done in zip(native._SOURCES, pool.map(check, native._SOURCES)):
            assert done.returncode == 0, f"{source} does not compile for aarch64:\n{done.stderr[-3000:]}"
