"""Which kernels run, and why: the one place kvlm decides whether the native kernels serve a path.

Two levels, one module:

* **The process** (`native_isa`): the native extension's ISA path (one of `native.ISAS`: `avx512-amx`,
  `avx512-vnni`, `avx512`, `avx2-vnni`, `avx2`, the NEON ones, `scalar`; `native.active_isa()` builds and
  probes it once, `KVLM_KERNEL_ISA` forces one), or None where the PyTorch references run (no compiler, a
  failed build, `KVLM_KERNEL_ISA=reference`).
  Every kernel wrapper (`quant`, `elementwise`, `paged_attention`, `kv_quant`, `argmax`, the grammar mask)
  asks `native_isa(x)` with the tensor it is about to hand the native op: the kernels take float32 CPU
  tensors, anything else (a CUDA or half-precision engine, by construction) takes the reference.
* **The engine** (`select_backend` -> `Backend`): decided once at engine construction from the device,
  the compute dtype and the model's shape, and logged (`kvlm info` and the startup log show it). It
  names the attention path, the matmul path of each weight format, the element-wise and sampler kernels,
  and the decode step, each with its reason. The runner, the loader and the K-center calibration read it;
  none re-derives it. A model the native attention kernel cannot read exactly (head_dim not a multiple of
  its 16-float vector) gets the gathered SDPA attention here, said in the log at load, instead of a
  per-call fallback behind an `in_place` flag.

This is vLLM's `current_platform` plus its one attention-backend selection, and nano-vllm's choice at
layer init, in one small object. A CUDA backend plugs in at `select_backend`: today a CUDA device gets
the PyTorch references (SDPA, BLAS), which is what the `device` branch returns.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

import torch

from kvlm.kernels import native
from kvlm.kernels.ggml_types import GGMLQuantizationType as Q

# Weight formats the native matmul kernels compute on in place (block layouts as in ggml).
NATIVE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# ... of which these quantize activations to int8 per 32 values on every native path (the default;
# KVLM_KERNEL_ACT=f32 opts out; `reference.qmatmul_int8_ref` defines the numerics).
INT8_ACT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K})
INT8_ISAS = frozenset(native.ISAS)  # every unit: x86 vector kernels, NEON, or the portable one (same bits)
# The units whose int8 kernel reads Q4_K weights packed in 16-row panels (`panels`, csrc/kernels_kquant_panels.h;
# AVX2: kernels_kquant_panels_avx2.h).
PANEL_ISAS = frozenset({"avx2", "avx2-vnni", "avx512", "avx512-vnni", "avx512-amx"})
ENV_PANELS = "KVLM_WEIGHT_PANELS"
# The paged attention kernel reads head_dim in 16-float vectors (csrc/kernels_impl.h).
ATTN_HEAD_DIM_MULTIPLE = 16


def native_isa(x: torch.Tensor | None = None) -> str | None:
    """The native kernels' ISA path, or None where the PyTorch references run. With x: None also when x
    is not a float32 CPU tensor (the only kind the native kernels take)."""
    if x is not None and (x.device.type != "cpu" or x.dtype != torch.float32):
        return None
    isa = native.active_isa()
    return None if isa == "reference" else isa


def isa_name() -> str:
    """The native kernels' ISA path, or "reference": for reports (`kvlm bench kernels`)."""
    return native_isa() or "reference"


def kernel_path(qtype: Q) -> str:
    """Which implementation `kernels.qmatmul` uses for a weight format: the ISA path ('avx512-vnni',
    'avx512', 'avx2', 'scalar') or 'reference', with '+int8' where activations are quantized to int8
    (e.g. 'avx2+int8' for Q4_K by default; KVLM_KERNEL_ACT=f32 turns that off)."""
    isa = native_isa()
    if qtype not in NATIVE_TYPES or isa is None:
        return "reference"
    if qtype in INT8_ACT_TYPES and isa in INT8_ISAS and native.int8_activations():
        return f"{isa}+int8"
    return isa


def panel_kernel(isa: str | None) -> bool:
    """Whether qmatmul on this ISA path reads panel-packed weights (int8 activations on an x86 vector unit)."""
    return isa in PANEL_ISAS and native.int8_activations()


def weight_panels() -> bool:
    """Whether the loader packs Q4_K weights in 16-row panels (`panels`): where this process's path reads
    them, unless KVLM_WEIGHT_PANELS=0 keeps the file's layout (an A/B of the two in one tree)."""
    return panel_kernel(native_isa()) and os.environ.get(ENV_PANELS, "1").strip() != "0"


# "paged-native": every row of every step attends over the cache's blocks in place with the native kernel,
# one computation per row (attention/paged.py); "paged-sdpa": the same call served by its PyTorch
# reference (each sequence's blocks gathered, then SDPA); "gathered-sdpa": each sequence's context fetched
# from the cache, then SDPA (attention/prefill.py, decode.py). The SDPA paths are exact across step
# shapes only to float32 rounding.
AttentionPath = Literal["paged-native", "paged-sdpa", "gathered-sdpa"]


@dataclass(frozen=True, slots=True)
class Backend:
    """What one engine runs on, decided once (`select_backend`), with the reason for each choice."""

    device: str  # "cpu", "cuda", ...
    isa: str  # the native ISA path, or "reference" (PyTorch: SDPA, BLAS, torch ops)
    dtype: str  # compute dtype of activations ("float32", "bfloat16", ...)
    attention: AttentionPath
    elementwise: Literal["native", "torch"]  # norms, RoPE, gated activations (kernels/elementwise.py)
    sampler: Literal["native", "torch"]  # argmax and the grammar bitmask (kernels/argmax.py, structured/mask.py)
    # "fused": decode-only steps run every layer in one native call (model/fused_decode.py); "modules":
    # the module tree. Decided when the runner is built (it needs the loaded model and cache).
    decode: Literal["fused", "modules"] = "modules"
    reasons: tuple[str, ...] = ()  # one clause per choice, for the log and `kvlm info`

    @property
    def native(self) -> bool:
        return self.isa != "reference"

    @property
    def in_place(self) -> bool:
        """Whether attention goes through the paged call (`AttentionMetadata.in_place`), native or not."""
        return self.attention != "gathered-sdpa"

    @property
    def native_rows(self) -> bool:
        """Whether dense float32 weights multiply on the native row kernel (F32 blocks), whose rows are
        bit-identical in any batch, instead of BLAS (`loader/build.py`)."""
        return self.native and self.device == "cpu" and self.dtype == "float32"

    @property
    def degraded(self) -> bool:
        """Native float32 kernels are here, yet this model's attention cannot take them (head_dim), so
        its rows are exact across step shapes only to float32 rounding: the engine warns at load."""
        return self.native and self.dtype == "float32" and self.attention != "paged-native"

    def with_decode(self, decode: Literal["fused", "modules"], why: str) -> Backend:
        return dataclasses.replace(self, decode=decode, reasons=(*self.reasons, f"decode {decode}: {why}"))

    def summary(self) -> str:
        """The choices without their reasons: `kvlm serve`'s ready line."""
        return f"backend {self.device}/{self.isa}, attention {self.attention}, decode {self.decode}"

    def describe(self) -> str:
        """One line for the startup log and `kvlm info`."""
        return (f"backend {self.device}/{self.isa}: attention {self.attention}, elementwise {self.elementwise}, "
                f"sampler {self.sampler}, decode {self.decode} ({'; '.join(self.reasons)})")

    def as_dict(self) -> dict[str, object]:
        return {"device": self.device, "isa": self.isa, "dtype": self.dtype, "attention": self.attention,
                "elementwise": self.elementwise, "sampler": self.sampler, "decode": self.decode,
                "reasons": list(self.reasons)}


def select_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> Backend:
    """The backend of an engine on `device` computing in `dtype`, for a model with this head_dim."""
    dev, dname = device.type, str(dtype).removeprefix("torch.")
    isa = native_isa()
    if dev != "cpu":  # the seam a CUDA backend plugs into: today the PyTorch references serve it
        return Backend(dev, "reference", dname, "gathered-sdpa", "torch", "torch",
                       reasons=(f"{dev}: the PyTorch references (SDPA, BLAS); the native kernels are CPU code",))
    if isa is None:
        why = ("KVLM_KERNEL_ISA=reference" if native.available() else
               "the native kernels are not built here (see the warning above)")
        return Backend(dev, "reference", dname, "gathered-sdpa", "torch", "torch",
                       reasons=(f"{why}: PyTorch references, exact across step shapes only to float32 rounding",))
    forced = isa != native.best_isa()
    reasons = [f"native kernels, ISA {isa} ({'forced by ' + native.ENV_ISA if forced else 'the best this CPU has'})"]
    attention: AttentionPath = "paged-native"
    if dtype != torch.float32:  # the native element-wise and attention kernels take float32 rows
        attention = "paged-sdpa"
        reasons.append(f"{dname} activations: attention and element-wise ops on the PyTorch references")
    elif head_dim % ATTN_HEAD_DIM_MULTIPLE:
        attention = "paged-sdpa"
        reasons.append(f"attention paged-sdpa: head_dim {head_dim} is not a multiple of {ATTN_HEAD_DIM_MULTIPLE} "
                       "(the native attention kernel's vector), so rows are exact across step shapes only to "
                       "float32 rounding")
    else:
        reasons.append("attention paged-native: every row reads the cache in place, one computation per row")
    elementwise = "native" if dtype == torch.float32 else "torch"
    return Backend(dev, isa, dname, attention, elementwise, "native", reasons=tuple(reasons))
