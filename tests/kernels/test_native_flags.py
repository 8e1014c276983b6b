"""The extension's compiler and linker flags per platform (kvlm/kernels/native.py `build_flags`).

macOS: Apple clang rejects `-fopenmp` as a driver flag, so the build there must reach OpenMP through the
preprocessor and link no OpenMP library by name (the symbols bind at load to torch's libomp). The cross-build
that shows clang compiles and links the sources with these flags for aarch64-macos is
scripts/macos_build_check.py (it downloads torch's macOS wheel and zig, so it is not run here)."""

from __future__ import annotations

import sys

from kvlm.kernels import native


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
