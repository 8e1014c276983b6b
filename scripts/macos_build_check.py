"""Cross-compile the native kernels for Apple silicon macOS and link them, with the flags `kvlm/kernels/native.py`
uses there: a check, from Linux, that a Mac's clang gets a command it accepts and sources it compiles.

    python scripts/macos_build_check.py [--keep DIR]

What it fetches (PyPI only, into a temporary directory): the macOS arm64 wheel of the torch installed here (for
its headers and the omp.h it ships) and `ziglang` (clang and a macOS SDK's headers and libraries, for
`-target aarch64-macos`). Every source is compiled as `cpp_extension` would on a Mac (the flags of
`native.build_flags("darwin")`, torch's include directories) and the objects are linked into one Mach-O
library with `-undefined dynamic_lookup`, as `cpp_extension` links on macOS. It prints one line: OK with the
library's size, or the first error. zig's clang is not Apple's: this shows the code and flags are right for
clang on macOS, not that Apple's toolchain or a Mac runs them (no Mac here).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvlm.kernels import native

PLATFORM = "macosx_14_0_arm64"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"], check=True)


def fetch(work: Path) -> tuple[Path, Path]:
    """(torch's macOS include directory, a directory holding the ziglang package)."""
    version = torch.__version__.split("+")[0]
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    wheels = work / "wheels"
    _pip("download", f"torch=={version}", "--no-deps", "--only-binary=:all:", "--platform", PLATFORM,
         "--python-version", py, "-d", str(wheels))
    wheel = next(wheels.glob("torch-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(work / "mac", [n for n in z.namelist() if n.startswith("torch/include/")])
    _pip("install", "--target", str(work / "zig"), "ziglang")
    return work / "mac" / "torch" / "include", work / "zig"


def build(work: Path, include: Path, zig: Path) -> Path:
    cflags, ldflags = native.build_flags("darwin")
    env = {**os.environ, "PYTHONPATH": str(zig)}
    cxx = [sys.executable, "-m", "ziglang", "c++", "-target", "aarch64-macos"]
    incs = [native._CSRC, include, include / "torch" / "csrc" / "api" / "include",
            Path(sysconfig.get_paths()["include"])]
    objs = work / "obj"
    objs.mkdir(exist_ok=True)

    def compile_one(src: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        cmd = [*cxx, *cflags, *(f"-I{d}" for d in incs), "-c", str(native._CSRC / src), "-o", str(objs / f"{src}.o")]
        return src, subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for src, r in pool.map(compile_one, native._SOURCES):
            if r.returncode:
                errors = [ln for ln in r.stderr.splitlines() if "error" in ln] or r.stderr.splitlines()[-1:]
                raise SystemExit(f"FAILED: {src}: {errors[0] if errors else f'exit {r.returncode}'}")
    lib = work / "kvlm_kernels_macos.so"
    r = subprocess.run([*cxx, "-shared", "-Wl,-undefined,dynamic_lookup", *sorted(map(str, objs.glob("*.o"))),
                        *ldflags, "-o", str(lib)], env=env, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"FAILED: link: {(r.stderr.strip().splitlines() or ['?'])[0]}")
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", type=Path, default=None, help="work in this directory and keep it")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvlm-macos-") as tmp:
        work = a.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        include, zig = fetch(work)
        lib = build(work, include, zig)
        flags, mib = " ".join(native.build_flags("darwin")[0]), lib.stat().st_size / 2**20
        print(f"OK: {len(native._SOURCES)} sources compiled for aarch64-macos with {flags} and linked: {lib.name}, "
              f"{mib:.1f} MiB (torch {torch.__version__.split('+')[0]} macOS headers, zig's clang)")


if __name__ == "__main__":
    main()
