"""The NEON int8 kernels on the x86 kernels' contract, bit for bit, under user-mode emulation.

No ARM machine runs this suite, so `tests/kernels/arm/contract_test.cpp` (every int8 format, M = 1, 2, 3, 8,
64, weight-group and row tails, split column ranges, against a scalar reference of the contract) is cross-compiled
with the extension's own unit sources (`isa_neon.cpp`: smull + sadalp; `isa_neon_dotprod.cpp`: sdot, built for
armv8.2-a+dotprod; `isa_neon_i8mm.cpp`: smmla 2 x 2 tiles) and run under `qemu-aarch64 -cpu max`; each binary
also checks the portable unit (one armv8-a object shared by the three, as the extension builds it). The same
program built natively checks the x86 units this CPU runs. Needs Debian's `g++-aarch64-linux-gnu` and
`qemu-user` (.ci/run installs them): skipped without them, a failure under CI=true.

Every object is compiled once per session, one compiler per core, at -O1 (OPT): these programs check bits, not
speed, and the bits do not depend on the optimisation level (-std=c++20 is ISO mode: no FP contraction, no
fast-math; the int8 sums are integers). -O3 took ~4x the compile time (about 3 minutes of the suite); the
extension's own -O3 build is what the rest of the suite checks on x86.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.deps import in_ci

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kvlm" / "kernels" / "csrc"
PROGRAM = Path(__file__).parent / "arm" / "contract_test.cpp"
CROSS, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"
OPT = "-O1"  # bits, not speed: see the module docstring
FLAGS = [OPT, "-std=c++20", "-fno-math-errno", "-Wno-psabi", "-Wall", "-Werror", f"-I{CSRC}"]

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


def _compile(cmd: list[str]) -> str | None:
    """None, or the failed command and the end of its stderr."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    return None if done.returncode == 0 else f"build failed: {' '.join(cmd)}\n{done.stderr[-4000:]}"


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module")
def contract_exes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """unit -> its contract program, or the build error: every object (the aarch64 portable unit once, shared by
    the three NEON programs) compiled in one pool, one compiler per core, then each program linked."""
    out = tmp_path_factory.mktemp("contract")
    cross, native_cxx = shutil.which(CROSS), shutil.which("g++")
    programs: dict[str, tuple[str, list[Path]]] = {}  # unit -> (compiler, its objects)
    jobs: dict[Path, list[str]] = {}  # object -> compile command

    def obj(cxx: str, name: str, source: Path, extra: list[str]) -> Path:
        path = out / f"{name}.o"
        jobs.setdefault(path, [cxx, *FLAGS, *extra, "-c", str(source), "-o", str(path)])
        return path

    builds = [(cross, unit, source, [f"-march={march}"], "aarch64") for unit, source, march in ARM_UNITS]
    if _is_x86():
        builds.append((native_cxx, "avx2", "isa_avx2.cpp", [], "x86"))
    for cxx, unit, source, extra, arch in builds:
        if cxx is None:
            continue  # the test itself says which tool is missing
        scalar = obj(cxx, f"scalar_{arch}", CSRC / "isa_scalar.cpp", ["-march=armv8-a"] if arch == "aarch64" else [])
        defines = [f"-DUNIT_FN=kvlm_kernels_{unit}", f'-DUNIT_NAME="{unit}"']
        programs[unit] = (cxx, [obj(cxx, f"program_{unit}", PROGRAM, [*extra, *defines]),
                                obj(cxx, unit, CSRC / source, extra), scalar])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = dict(zip(jobs, pool.map(_compile, jobs.values())))
    exes: dict[str, Path | str] = {}
    for unit, (cxx, objects) in programs.items():
        failed = [errors[o] for o in objects if errors[o] is not None]
        exe = out / f"contract_{unit}"
        exes[unit] = failed[0] if failed else _compile([cxx, *map(str, objects), "-o", str(exe)]) or exe
    return exes


def _exe(exes: dict[str, Path | str], unit: str) -> Path:
    built = exes[unit]
    assert isinstance(built, Path), built
    return built


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("OK"), (done.stdout + done.stderr)[-4000:]
    return done.stdout


@pytest.mark.parametrize(("unit", "source", "march"), ARM_UNITS, ids=[u[0] for u in ARM_UNITS])
def test_neon_int8_kernels_are_the_contract_under_qemu(unit: str, source: str, march: str,
                                                       contract_exes: dict[str, Path | str]) -> None:
    """The NEON unit's quantize_act and gemv_i8 (and the portable unit's, on aarch64) give the contract's
    bits for every format and shape, whole and split over column ranges; its BF16 gemv gives the bits of
    csrc/kernels_bf16.h's contract (FPCR.FZ for the flushes)."""
    _need(CROSS)
    qemu = _need(QEMU)
    exe = _exe(contract_exes, unit)
    if unit == "neon_i8mm":  # the tiles are compiled to smmla, not folded into another path
        objdump = shutil.which("aarch64-linux-gnu-objdump")
        if objdump is not None:
            asm = subprocess.run([objdump, "-d", str(exe)], capture_output=True, text=True, timeout=300, check=False)
            assert "smmla" in asm.stdout, "the i8mm unit has no smmla instruction"
    out = _run([qemu, "-cpu", "max", "-L", SYSROOT, str(exe), "quick"])
    assert out.count("checks") == 9, out  # 8 int8 formats and BF16


def test_x86_int8_kernels_are_the_contract_natively(contract_exes: dict[str, Path | str]) -> None:
    """The same program, native: the AVX2 unit (where this CPU has it) and the portable unit."""
    if not _is_x86():
        pytest.skip(f"x86 units; this is {platform.machine()}")
    from kvlm.kernels import native

    _need("g++")
    exe = _exe(contract_exes, "avx2")
    if native.available() and not native.isa_available("avx2"):
        pytest.skip("this CPU lacks AVX2 (the program was built; the portable unit runs in the qemu tests)")
    out = _run([str(exe), "quick"])
    assert out.count("checks") == 9, out  # 8 int8 formats and BF16


def test_extension_sources_compile_for_aarch64() -> None:
    """Every extension source (ops, drivers, argmax, ...) compiles for aarch64 with torch's headers (syntax only:
    no aarch64 torch to link here), so the extension builds on ARM, not only the kernel units above."""
    import sysconfig

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
