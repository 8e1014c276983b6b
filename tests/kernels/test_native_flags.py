"""The extension's compiler and linker flags per platform (kvlm/kernels/native.py `build_flags`).

macOS: Apple clang rejects `-fopenmp` as a driver flag, so the build there must reach OpenMP through the
preprocessor and link no OpenMP library by name (the symbols bind at load to torch's libomp). The cross-build
that shows clang compiles and links the sources with these flags for aarch64-macos is
scripts/macos_build_check.py (it downloads torch's macOS wheel and zig, so it is not run here)."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from kvlm.kernels import native
from tests.helpers.deps import need_native


def test_macos_reaches_openmp_through_the_preprocessor() -> None:
    cflags, ldflags = native.build_flags("darwin")
    at = [i for i, f in enumerate(cflags) if f == "-fopenmp"]
    assert at and all(i > 0 and cflags[i - 1] == "-Xpreprocessor" for i in at)
    assert not any("omp" in f for f in ldflags)
    assert {"-O3", "-std=c++20"} <= set(cflags)


def test_linux_keeps_gcc_openmp() -> None:
    cflags, ldflags = native.build_flags("linux")
    assert "-fopenmp" in cflags and "-Xpreprocessor" not in cflags and ldflags == ("-fopenmp",)


def test_this_build_uses_this_platform_flags() -> None:
    assert (native._CFLAGS, native._LDFLAGS) == native.build_flags(sys.platform)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def _tile_data_granted() -> bool:
    """Whether this process may use AMX's tile data (arch_prctl ARCH_GET_XCOMP_PERM: bit 18, XTILEDATA)."""
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    mask = ctypes.c_uint64(0)
    return libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0 and bool(mask.value >> 18 & 1)  # SYS_arch_prctl


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists(),
                    reason="x86 Linux: the paths are read against /proc/cpuinfo")
def test_x86_paths_follow_the_cpu_flags() -> None:
    """avx2-vnni runs where the CPU has AVX2 and AVX-VNNI, and is the best path only without AVX-512;
    avx512-amx where the CPU also has AMX's tiles and int8 products, and is then the best."""
    need_native("the ISA checks are the extension's")
    flags = _cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    avx2 = {"avx2", "fma", "f16c", "bmi2"} <= flags
    assert native.isa_available("avx2") == avx2
    assert native.isa_available("avx512") == avx512
    assert native.isa_available("avx512-vnni") == (avx512 and "avx512_vnni" in flags)
    assert native.isa_available("avx2-vnni") == (avx2 and "avx_vnni" in flags)
    # AMX also needs Linux's grant of the tile state, which the extension asks for (ops.cpp x86_amx)
    got_amx = native.isa_available("avx512-amx")
    amx = avx512 and "avx512_vnni" in flags and {"amx_tile", "amx_int8"} <= flags and _tile_data_granted()
    assert got_amx == amx
    expected = ("avx512-amx" if amx else "avx512-vnni" if "avx512_vnni" in flags else "avx512") if avx512 else (
        ("avx2-vnni" if "avx_vnni" in flags else "avx2") if avx2 else "scalar")
    assert native.best_isa() == expected
