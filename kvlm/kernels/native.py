"""The native kernel extension: built once per machine at first use, loaded, and which ISA path runs.

The C++ sources in `csrc/` are compiled with `torch.utils.cpp_extension` (not at `pip install`: build
isolation would compile against another torch) into `$KVLM_HOME/ext/<key>/`, where the key hashes the
sources, the compiler flags, the compiler and the torch and Python versions. A file lock makes
parallel processes (pytest workers) build once and the others wait; later processes only load the
shared library (milliseconds). Computing that key runs `c++ --version` and reads every source, so a
stamp (`ext/stamps/<sources' sizes and mtimes>`) remembers it: a start with unchanged sources only
stats them. Where the compiler, headers or build fail, one line is logged (what is missing, that every
kernel then runs its much slower pure-PyTorch reference, how to fix it) and torch's own warnings about the
compiler are held back: never a crash, never a block of someone else's advice.

The path is the best one this CPU supports (x86: `avx512-amx` > `avx512-vnni` > `avx512` > `avx2-vnni` > `avx2` >
`scalar`; `avx512-vnni` is `avx512` plus vpdpbusd in the int8 kernels, `avx512-amx` `avx512-vnni` plus AMX tiles
for their many-row case (Xeon since Sapphire Rapids), `avx2-vnni` `avx2` plus AVX-VNNI's (a CPU with AVX-512 may
lack it); aarch64: `neon-i8mm` (sdot + smmla) > `neon-dotprod` (sdot) > `neon` > `scalar`), or the one forced by
`KVLM_KERNEL_ISA=avx512-amx|avx512-vnni|avx512|avx2-vnni|avx2|neon-i8mm|neon-dotprod|neon|scalar|reference`,
read once per process (reading the environment costs
microseconds, and a decode step makes ~120 kernel calls); `refresh()` re-reads it (tests use that).
`KVLM_KERNEL_ACT=f32` opts out of int8 activations for Q4_0 / Q4_1 / Q8_0 (`int8_activations`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvlm.paths import kvlm_home

logger = logging.getLogger("kvlm")

# index = the id the C++ side uses (drivers.h); x86 ids 1-3 and aarch64 ids 4-6 are not one order, and
# avx2-vnni (7: AVX2 + AVX-VNNI) stands beside the x86 one (AVX-512 CPUs may lack AVX-VNNI); avx512-amx (8) is
# avx512-vnni plus AMX tiles, above it
ISAS = ("scalar", "avx2", "avx512", "avx512-vnni", "neon", "neon-dotprod", "neon-i8mm", "avx2-vnni", "avx512-amx")
PATHS = (*ISAS, "reference")
ENV_ISA = "KVLM_KERNEL_ISA"

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("ops.cpp", "decode.cpp", "moe.cpp", "elementwise.cpp", "kv_quant.cpp", "token_mask.cpp", "argmax.cpp",
            "isa_scalar.cpp", "isa_avx2.cpp", "isa_avx2_vnni.cpp", "isa_avx512.cpp", "isa_avx512_vnni.cpp",
            "isa_avx512_amx.cpp", "isa_neon.cpp", "isa_neon_dotprod.cpp", "isa_neon_i8mm.cpp")
_HEADERS = ("kernels.h", "kernels_impl.h", "kernels_bf16.h", "kernels_int8.h", "kernels_int8_panel.h",
            "kernels_int8_avx2.h", "kernels_int8_amx.h", "kernels_kquant.h", "kernels_kquant_panels.h",
            "kernels_kquant_panels_avx2.h",
            "kernels_int8_portable.h", "drivers.h", "elementwise.h", "kernels_attn_quant.h", "kv_quantize.h")


def build_flags(system: str = sys.platform) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compiler flags, linker flags) of the extension on `system` (a `sys.platform` value).

    -std=c++20: torch 2.13's headers need it. OpenMP: at::parallel_for is an inline `omp parallel`, and
    decode.cpp opens its own region (serial without either); the library then binds to the OpenMP
    runtime torch has already loaded (libgomp.so.1 on Linux), so it shares torch's thread pool and
    torch.set_num_threads. The ISA units set their own `#pragma GCC target` (clang: target attributes).
    macOS: Apple clang has no `-fopenmp` driver flag, so the pragmas are turned on through the preprocessor;
    omp.h is the one torch's macOS wheels ship in torch/include (on the include path of every extension
    build), and the runtime symbols bind at load to torch's libomp.dylib (cpp_extension links with
    `-undefined dynamic_lookup` there). Not linked by name: that dylib's install name is its build
    machine's path. Checked by cross-compiling for aarch64-macos (scripts/macos_build_check.py), not run on a Mac.
    """
    if system == "darwin":  # (clang has no -Wmaybe-uninitialized: it would only warn about the flag)
        return ("-O3", "-std=c++20", "-Xpreprocessor", "-fopenmp", "-Wno-psabi", "-fno-math-errno"), ()
    return ("-O3", "-std=c++20", "-fopenmp", "-Wno-psabi", "-Wno-maybe-uninitialized", "-fno-math-errno"), ("-fopenmp",)


_CFLAGS, _LDFLAGS = build_flags()


def _compiler() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unavailable"
    return f"{cxx}\n{version.splitlines()[0] if version else ''}"


def _build_key() -> str:
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        h.update(name.encode() + b"\0" + (_CSRC / name).read_bytes())
    for part in (*_CFLAGS, *_LDFLAGS, _compiler(), torch.__version__, sys.version, platform.machine()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _stat_key() -> str:
    """A cheap stand-in for `_build_key` (no compiler run, no source read): the sources' sizes and
    modification times with everything else the build key hashes except the compiler's version."""
    h = hashlib.sha256()
    for name in (*_SOURCES, *_HEADERS):
        st = (_CSRC / name).stat()
        h.update(f"{_CSRC / name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for part in (*_CFLAGS, *_LDFLAGS, os.environ.get("CXX", "c++"), torch.__version__, sys.version, platform.machine()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def _ext_root() -> Path:
    return kvlm_home() / "ext"


def _library(key: str) -> Path:
    return _ext_root() / key / f"kvlm_kernels_{key}.so"


def _cached_key() -> str | None:
    """The build key recorded for these exact source files (`stamps/<stat key>`) when its library
    exists: a start then only stats the sources. Editing a source changes its size or mtime, so the
    stamp misses and `_build_key` (which reads them) decides whether to rebuild."""
    try:
        key = (_ext_root() / "stamps" / _stat_key()).read_text().strip()
    except OSError:
        return None
    return key if len(key) == 16 and _library(key).exists() else None


def _write_stamp(key: str) -> None:
    stamp = _ext_root() / "stamps" / _stat_key()
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    try:  # write then rename: a reader never sees half a key
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(key)
        os.replace(tmp, stamp)
    except OSError:  # a read-only home only costs the full key at the next start
        tmp.unlink(missing_ok=True)


def _build_and_load() -> None:
    key = _cached_key()
    if key is not None:
        torch.ops.load_library(str(_library(key)))
        return
    key = _build_key()
    name = f"kvlm_kernels_{key}"
    build_dir = _ext_root() / key
    lib = build_dir / f"{name}.so"
    if not lib.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir.parent / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per machine; the others wait, then load
            if not lib.exists():
                # torch's cpp_extension takes its own `lock` file in build_dir and waits forever while one
                # exists; a build killed midway leaves it behind. Under our flock no other builder runs,
                # so such a file is stale and would only hang this build.
                (build_dir / "lock").unlink(missing_ok=True)
                _compile(name, build_dir)
    torch.ops.load_library(str(lib))
    _write_stamp(key)


class BuildUnavailable(RuntimeError):
    """Why the extension cannot be built here, as the one line `available()` logs (no traceback)."""


_FALLBACK = "every kernel runs its PyTorch reference instead, much slower"


def _check_compiler() -> None:
    """Fail fast, in words, where `$CXX` (default `c++`) is missing or cannot compile one line of C++:
    torch's build would otherwise log a warning block about 'compatible compilers' and then a ninja error."""
    cxx = os.environ.get("CXX", "c++")
    fix = "install one (Debian/Ubuntu: apt install g++) or point CXX at one"
    if shutil.which(cxx) is None:
        raise BuildUnavailable(f"no C++ compiler ({cxx} not found): {_FALLBACK}; to fix it, {fix}")
    try:
        r = subprocess.run([cxx, "-x", "c++", "-fsyntax-only", "-"], input="int main() { return 0; }\n",
                           check=False, capture_output=True, text=True, timeout=60)
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[0][:200] if r.returncode else ""
    except (OSError, subprocess.SubprocessError) as e:
        why = str(e)[:200]
    if why:
        raise BuildUnavailable(f"the C++ compiler {cxx} does not work ({why}): {_FALLBACK}; to fix it, {fix}")


@contextmanager
def _quiet_torch_build() -> Iterator[None]:
    """Hold back torch.utils.cpp_extension's warnings (a compiler it does not recognise by name, say):
    a build that fails says why in one line of ours, and one that works needs no advice."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        torch_log.setLevel(level)


def _first_error(output: str) -> str:
    """The compiler's first `error:` line in a failed build's output (gcc and clang both write
    `file:line:col: error: ...` or `fatal error: ...`), else the output's last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror:", line)]
    return (errors[0] if errors else lines[-1] if lines else "no output")[:300]


def _compile(name: str, build_dir: Path) -> None:
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        raise BuildUnavailable(f"ninja is not installed: {_FALLBACK}; to fix it, pip install ninja")
    _check_compiler()
    logger.info("kvlm: compiling the native kernels once into %s (about a minute)", build_dir)
    try:
        with _quiet_torch_build():
            cpp_extension.load(
                name=name,
                sources=[str(_CSRC / s) for s in _SOURCES],
                extra_cflags=list(_CFLAGS),
                extra_ldflags=list(_LDFLAGS),
                extra_include_paths=[str(_CSRC)],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001 - keep the whole output for whoever fixes it; say one line here
        log = build_dir / "build-error.log"
        try:
            log.write_text(str(e))
        except OSError:
            log = build_dir
        raise BuildUnavailable(f"the native kernels failed to build ({_first_error(str(e))}; full output in {log}): "
                               f"{_FALLBACK}") from e


_load_lock = threading.Lock()


@functools.cache
def available() -> bool:
    """Whether the native extension is built and loaded in this process (builds it on the first call)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        logger.warning("kvlm: native kernels target x86-64 and aarch64; using the PyTorch reference kernels on %s",
                       platform.machine())
        return False
    try:
        with _load_lock:
            _build_and_load()
        return True
    except BuildUnavailable as e:
        logger.warning("kvlm: %s", e)
        return False
    except Exception as e:  # noqa: BLE001 - any other build or load failure means: use the reference
        first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
        logger.warning("kvlm: the native kernels could not be loaded (%s): %s", first, _FALLBACK)
        return False


@dataclass(frozen=True, slots=True)
class NativeOps:
    """Handles of the loaded ops (`torch.ops.kvlm_kernels.<op>.default`: the cheapest way to call them)."""

    qmatmul: Any
    qmatmul_i8: Any
    fake_quantize_act: Any
    dequantize: Any
    paged_decode_attention: Any
    paged_attention: Any
    decode_plan_create: Any
    decode_plan_free: Any
    decode_step: Any
    rms_norm: Any
    silu_mul: Any
    rope: Any
    gelu_tanh_mul: Any
    kv_quantize: Any
    hadamard: Any
    decode_lora_create: Any  # a LoRA adapter's plan for decode_step (model/fused_decode.py)
    decode_lora_free: Any
    lora_b_add: Any  # a LoRA adapter's B product (kvlm/lora/rows.py; the fused step's too)
    expert_qmatmul: Any  # mixture-of-experts: a projection of every chosen expert in one call (model/moe.py)
    moe_mlp: Any  # a routed MLP (router, top-k, experts, weighted sum) in one call (model/moe.py, csrc/moe.cpp)
    moe_route: Any  # the routing alone (router logits -> top-k ids and weights)
    moe_buffers: Any  # moe_mlp's work-buffer budget per pass and the bytes this thread's buffers hold (tests)
    qmatmul_parts: Any  # a layer's separate q / k / v or gate / up parts on x quantized once (kernels/quant.py)


@functools.cache
def ops() -> NativeOps | None:
    """The native ops, or None where the extension is unavailable."""
    if not available():
        return None
    ns = torch.ops.kvlm_kernels
    return NativeOps(ns.qmatmul.default, ns.qmatmul_i8.default, ns.fake_quantize_act.default, ns.dequantize.default,
                     ns.paged_decode_attention.default, ns.paged_attention.default, ns.decode_plan_create.default,
                     ns.decode_plan_free.default, ns.decode_step.default, ns.rms_norm.default,
                     ns.silu_mul.default, ns.rope.default, ns.gelu_tanh_mul.default, ns.kv_quantize.default,
                     ns.hadamard.default, ns.decode_lora_create.default, ns.decode_lora_free.default,
                     ns.lora_b_add.default, ns.expert_qmatmul.default, ns.moe_mlp.default, ns.moe_route.default,
                     ns.moe_buffers.default, ns.qmatmul_parts.default)


@functools.cache
def best_isa() -> str:
    """The fastest ISA path this CPU supports, or 'reference' without the extension."""
    if not available():
        return "reference"
    return ISAS[torch.ops.kvlm_kernels.best_isa()]


def isa_available(isa: str) -> bool:
    """Whether this CPU runs the ISA path `isa` (one of ISAS) with the extension built."""
    return available() and bool(torch.ops.kvlm_kernels.isa_available(ISAS.index(isa)))


@functools.cache
def active_isa() -> str:
    """The path kernels take: `KVLM_KERNEL_ISA` if set (and possible here), else the best one."""
    forced = os.environ.get(ENV_ISA, "").strip().lower()
    if forced == "reference":
        return "reference"
    if forced and forced not in ISAS:
        raise ValueError(f"{ENV_ISA} must be one of {', '.join(PATHS)}, got {forced!r}")
    best = best_isa()
    if not forced or best == "reference":
        return best
    if not isa_available(forced):
        logger.warning("kvlm: %s=%s is not available here; using %s", ENV_ISA, forced, best)
        return best
    return forced


ENV_ACT = "KVLM_KERNEL_ACT"


@functools.cache
def int8_activations() -> bool:
    """Whether Q4_0 / Q4_1 / Q8_0 matmuls quantize activations to int8 per 32-element block (llama.cpp
    style; `reference.qmatmul_int8_ref` defines the numerics) on the AVX2 / AVX-512 paths: the default
    (`KVLM_KERNEL_ACT=int8`). `KVLM_KERNEL_ACT=f32` opts out: activations stay float32 (exact up to
    summation order). The scalar and reference paths always use float32 activations."""
    mode = os.environ.get(ENV_ACT, "int8").strip().lower()
    if mode not in ("f32", "int8"):
        raise ValueError(f"{ENV_ACT} must be f32 or int8, got {mode!r}")
    return mode == "int8"


def refresh() -> None:
    """Re-read KVLM_KERNEL_ISA and KVLM_KERNEL_ACT (after changing them in this process)."""
    active_isa.cache_clear()
    int8_activations.cache_clear()


def isa_id(isa: str) -> int:
    return ISAS.index(isa)
