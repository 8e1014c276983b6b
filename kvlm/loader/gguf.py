"""GGUF files -> (`ModelConfig`, HF-named float tensors, tokenizer metadata).

This module owns everything GGUF-specific: checking the header before trusting any size in it,
translating `{arch}.*` metadata into `ModelConfig` fields, dequantizing tensors with the `gguf` package,
the GGUF -> Hugging Face tensor-name table and the Q/K RoPE un-permute that llama.cpp's converter applied.
It knows nothing about the model code beyond those names.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported where tensors are made: reading a config (`kvlm kv-size`) needs no torch
    import torch

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
# Sanity limits for the header counts: a corrupt header must not make us allocate or loop for ever.
_MAX_TENSORS = 1_000_000
_MAX_KV = 1_000_000

# Tensor types we dequantize (the gguf package implements them in numpy).
SUPPORTED_TENSOR_TYPES = frozenset(
    ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
)

# GGUF architecture -> HF model_type.
_ARCH_TO_MODEL_TYPE = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                       "phi3": "phi3", "smollm3": "smollm3", "granite": "granite", "gemma3": "gemma3_text",
                       "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}  # Mixtral: "llama" with expert tensors
# Architectures whose Q/K rows llama.cpp's converter permuted (its LlamaModel and subclasses: RoPE type NORM).
PERMUTED_QK = frozenset({"llama", "smollm3", "granite"})

# The one GGUF -> HF name table. Per-layer names are under "blk.{i}." / "model.layers.{i}.".
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",  # llama3-style per-frequency scaling factors
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q/k/v stored fused, kvlm's own stacked projection
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router (E x hidden) and the experts stacked (E, out, in), as llama.cpp stores them
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Gemma 3's four norms per layer: llama.cpp's `ffn_norm` is HF's pre-feedforward norm there.
_GEMMA3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                       "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Phi-3's `ffn_up` holds gate and up fused (2 x feed_forward_length rows, gate first): HF's gate_up_proj.
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# What llama.cpp hard-codes for Gemma 3 and its GGUF files do not carry: every 6th layer attends in full,
# the others within `attention.sliding_window` with RoPE base 10,000 (llama-model.cpp, LLM_ARCH_GEMMA3).
GEMMA3_FULL_EVERY, GEMMA3_LOCAL_ROPE_BASE = 6, 10_000.0
# ... and for SmolLM3: every 4th layer has no RoPE (llama-model.cpp, n_no_rope_layer_step = 4).
SMOLLM3_NO_ROPE_EVERY = 4
# Phi-3's LongRoPE factors, per rotary frequency, are tensors in the file (not metadata).
ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """Map a GGUF tensor name to its HF name; None for tensors we do not use."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    names = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _PHI3_LAYER_NAMES if arch == "phi3" else _LAYER_NAMES
    if m and m.group(2) in names:
        hf = names[m.group(2)]
        # stacked experts are parameters of their module, named without ".weight" (transformers 5's naming)
        return f"model.layers.{m.group(1)}.{hf}" if hf.startswith("mlp.experts.") else \
            f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    return None


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation (interleaved RoPE pairs -> HF's rotate-half halves).

    The converter reshaped each head's rows as (2, head_dim/2) and swapped to (head_dim/2, 2); we swap back.
    Works for weights (rows, cols) and biases (rows,).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter's Q/K permutation (HF's halves -> interleaved pairs): `unpermute_rope`'s inverse,
    for the files kvlm writes for llama.cpp (bench lora's GGUF LoRA)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_header(path: Path) -> None:
    """The fixed 24-byte header: magic, version and plausible counts, before anything else is read."""
    size = path.stat().st_size
    if size < 24:
        raise ModelLoadError(f"{path}: not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {head[:4]!r})")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: unsupported GGUF version {version}")
    # Each tensor info and each key/value takes at least ~24 bytes in the file.
    if n_tensors > _MAX_TENSORS or n_kv > _MAX_KV or 24 * (n_tensors + n_kv) > size:
        raise ModelLoadError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")


def read_gguf(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """Open a GGUF file after checking it; returns (GGUFFile, metadata as plain Python values).
    GGUFFile checks every length in the metadata and tensor table against the file size as it parses
    (one pass); its ValueError becomes one `ModelLoadError` sentence naming the file."""
    from kvlm.loader.gguf_file import GGUFFile

    p = Path(path)
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such model file")
    check_header(p)
    try:
        reader = GGUFFile(p)  # not gguf.GGUFReader: same values, seconds faster (see gguf_file)
    except ValueError as e:
        raise ModelLoadError(f"{p}: corrupt or truncated GGUF file ({str(e)[:200]})") from None
    except Exception:  # noqa: BLE001 (damage the parser does not model: bad UTF-8 in a name, ...)
        raise ModelLoadError(f"{p}: corrupt GGUF file (its metadata cannot be decoded)") from None
    return reader, reader.fields


def rope_factors(reader: Any) -> dict[str, list[float]]:
    """Phi-3's LongRoPE factor tensors (`ROPE_FACTOR_TENSORS`, a few dozen floats each) by name."""
    return {t.name: dequantize_tensor(t).tolist() for t in reader.tensors if t.name in ROPE_FACTOR_TENSORS}


def config_from_gguf(fields: dict[str, Any], tensor_names: set[str],
                     factors: dict[str, list[float]] | None = None) -> ModelConfig:
    """Translate GGUF metadata into a `ModelConfig` (HF field names); nonsense values (a string where a
    count belongs, zero heads) are a `ModelLoadError`. `factors`: `rope_factors(reader)`, for Phi-3."""
    try:
        return _config_from_gguf(fields, tensor_names, factors or {})
    except (ValueError, TypeError, KeyError, ArithmeticError) as e:
        raise ModelLoadError(f"invalid GGUF metadata ({type(e).__name__}: {str(e)[:120]})") from None


def _config_from_gguf(fields: dict[str, Any], tensor_names: set[str], factors: dict[str, list[float]]) -> ModelConfig:
    arch = fields.get("general.architecture")
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise UnsupportedModelError(
            f"unsupported architecture {arch!r}; kvlm supports {', '.join(sorted(_ARCH_TO_MODEL_TYPE))}"
        )

    def get(key: str, default: Any = None) -> Any:
        val = fields.get(f"{arch}.{key}", default)
        if val is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return val

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or [])
    rope_scaling = None
    if fields.get(f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        n_layers, head_dim = int(get("block_count")), int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
        extra = {"layer_types": tuple("full_attention" if (i + 1) % GEMMA3_FULL_EVERY == 0 else "sliding_attention"
                                      for i in range(n_layers)),
                 "sliding_window": int(get("attention.sliding_window")),
                 "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
                 # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(hidden / heads)
                 "query_pre_attn_scalar": float(hidden // heads if n_layers == 62 else head_dim),
                 "hidden_activation": "gelu_pytorch_tanh"}
    elif arch == "phi3":
        extra = _phi3_fields(fields, factors, hidden // heads, int(get("context_length", 2048)))
        if extra.get("rope_scaling"):
            rope_scaling = extra.pop("rope_scaling")
    elif arch == "smollm3":
        extra = {"no_rope_layers": tuple(int((i + 1) % SMOLLM3_NO_ROPE_EVERY != 0)
                                         for i in range(int(get("block_count"))))}
    elif arch == "granite":  # the converter writes each multiplier only where the config has it
        extra = {k: float(fields[f"{arch}.{key}"]) for k, key in (
            ("embedding_multiplier", "embedding_scale"), ("attention_multiplier", "attention.scale"),
            ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale")) if f"{arch}.{key}" in fields}
    model_type = _ARCH_TO_MODEL_TYPE[arch]
    if f"{arch}.expert_count" in fields and int(fields[f"{arch}.expert_count"]) > 0:
        if arch == "llama":
            model_type = "mixtral"
        elif arch not in ("qwen3moe", "olmoe"):
            raise UnsupportedModelError(f"mixture-of-experts {arch!r} models are not supported")
        extra.update(_moe_fields(fields, arch))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(fields.get(f"{arch}.feed_forward_length") or extra.get("moe_intermediate_size") or 0),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // heads),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
        **extra,
    )


def _moe_fields(fields: dict[str, Any], arch: str) -> dict[str, Any]:
    """Expert metadata as ModelConfig fields. llama.cpp renormalises the top-k weights for Qwen3-MoE and
    Mixtral and not for OLMoE (its graph builders' fixed choice) unless the file says `expert_weights_norm`;
    every layer is routed (llama.cpp's Qwen3-MoE has no dense layers)."""
    ff = f"{arch}.expert_feed_forward_length"
    out: dict[str, Any] = {
        "num_experts": int(fields[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(fields[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(fields[ff] if ff in fields else fields[f"{arch}.feed_forward_length"]),
        "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", arch != "olmoe")),
    }
    if arch == "olmoe":
        out["qk_norm_full"] = True
    return out


def _phi3_fields(fields: dict[str, Any], factors: dict[str, list[float]], head_dim: int,
                 context: int) -> dict[str, Any]:
    """Phi-3 metadata as ModelConfig fields: RoPE on `rope.dimension_count` values of each head (Phi-4-mini:
    3/4), LongRoPE where the file has the factor tensors (with `rope.scaling.attn_factor` and the original
    context), the sliding window (0: none, as the converter marks Phi-4)."""
    rot = int(fields.get("phi3.rope.dimension_count") or head_dim)
    out: dict[str, Any] = {"partial_rotary_factor": rot / head_dim}
    window = int(fields.get("phi3.attention.sliding_window") or 0)
    out["sliding_window"] = window if 0 < window < context else None
    if all(n in factors for n in ROPE_FACTOR_TENSORS):
        out["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": factors[ROPE_FACTOR_TENSORS[0]],
            "short_factor": factors[ROPE_FACTOR_TENSORS[1]],
            "attention_factor": fields.get("phi3.rope.scaling.attn_factor"),
            "original_max_position_embeddings": int(fields.get("phi3.rope.scaling.original_context_length")
                                                    or context)}
    return out


def dequantize_tensor(t: Any) -> torch.Tensor:
    """One GGUF tensor -> float32 torch tensor in HF (row-major, out x in) shape."""
    qtype = t.tensor_type.name
    if qtype not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(f"tensor {t.name} has unsupported type {qtype}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
    if qtype == "F32":
        arr = np.array(t.data, dtype=np.float32)  # copy: the reader memory-maps read-only
    elif qtype == "F16":
        arr = np.asarray(t.data, dtype=np.float16).astype(np.float32)
    else:
        from gguf import quants  # block decoding (its import pulls in yaml: only when needed)

        arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def file_bytes(reader: Any) -> torch.Tensor:
    """The whole memory-mapped file as a read-only uint8 tensor, sharing the reader's mapping (no copy).

    torch warns that the array is not writable; nothing writes to it (weights are only read)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(reader.data)


def quant_tensor(t: Any, mapped: torch.Tensor) -> Any:
    """A 2-D GGUF tensor as a `kernels.QuantTensor` over the mapped file, a 3-D one (stacked experts) as a
    `kernels.ExpertStack`: nothing is read or converted."""
    from kvlm.kernels import ExpertStack, QuantTensor
    from kvlm.kernels.ggml_types import GGML_QUANT_SIZES

    if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
        raise UnsupportedModelError(f"tensor {t.name} has unsupported type {t.tensor_type.name}")
    dims = [int(d) for d in reversed(t.shape.tolist())]  # GGUF lists dims fastest-first
    elems, nbytes = GGML_QUANT_SIZES[t.tensor_type]
    k = dims[-1]
    row_bytes = k // elems * nbytes
    rows = int(np.prod(dims[:-1]))
    data = mapped[t.data_offset : t.data_offset + rows * row_bytes].view(*dims[:-1], row_bytes)
    if len(dims) == 3:
        return ExpertStack(data, t.tensor_type, (dims[0], dims[1], k))
    return QuantTensor(data, t.tensor_type, (dims[0], k))


def weight_formats(reader: Any) -> dict[str, dict[str, Any]]:
    """Per stored tensor type: how many weights, their bytes, and the kernel that computes on them
    under `--dtype auto` (`kernels.kernel_path`; 1-D tensors, norms and biases, are float32 vectors)."""
    from kvlm.kernels import kernel_path

    out: dict[str, dict[str, Any]] = {}
    arch = str(reader.fields.get("general.architecture", "llama"))
    for t in reader.tensors:
        if gguf_to_hf_name(t.name, arch) is None:
            continue
        matrix = len(t.shape) in (2, 3)
        key = t.tensor_type.name + ("" if matrix else " (1-D)")
        row = out.setdefault(key, {"tensors": 0, "bytes": 0,
                                   "kernel": kernel_path(t.tensor_type) if matrix else "float32 vector ops"})
        row["tensors"] += 1
        row["bytes"] += int(t.n_bytes)
    return out


def bytes_per_token(reader: Any, config: ModelConfig) -> int:
    """Weight bytes one decode token reads from this file: every matrix but the embedding table (one row of
    it, unless tied to the output), and of each layer's stacked experts the `num_experts_per_tok` it routes
    to (k / E of their bytes)."""
    arch = str(reader.fields.get("general.architecture", "llama"))
    total = 0.0
    for t in reader.tensors:
        if gguf_to_hf_name(t.name, arch) is None:
            continue
        n = int(t.n_bytes)
        if t.name == "token_embd.weight" and not config.tie_word_embeddings:
            n //= max(1, config.vocab_size)
        if len(t.shape) == 3:
            n = n * config.num_experts_per_tok / max(1, config.num_experts)
        total += n
    return int(total)


def load_gguf(path: str | os.PathLike,
              quantized: bool = False) -> tuple[ModelConfig, dict[str, Any], dict[str, Any]]:
    """Load a GGUF model: (config, HF-named state dict, metadata fields for the tokenizer).

    quantized=False: every tensor dequantized to float32 (the reference path). quantized=True: every
    2-D weight is a `QuantTensor` viewing the memory-mapped file in its stored format (Q/K rows
    un-permuted as byte rows, a copy of those two small matrices); 1-D tensors (norms, biases) float32.
    """
    reader, fields = read_gguf(path)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(fields, names, rope_factors(reader))
    mapped = file_bytes(reader) if quantized else None
    state: dict[str, Any] = {}
    arch = fields.get("general.architecture")
    for t in reader.tensors:
        hf = gguf_to_hf_name(t.name, arch)
        if hf is None:
            continue
        try:
            if mapped is not None and len(t.shape) in (2, 3):
                w = quant_tensor(t, mapped)
            else:
                w = dequantize_tensor(t)
        except (ValueError, AssertionError) as e:
            raise ModelLoadError(f"{path}: cannot read tensor {t.name} ({str(e)[:120]})") from None
        if arch in PERMUTED_QK:
            heads = (config.num_attention_heads if ".q_proj." in hf
                     else config.num_key_value_heads if ".k_proj." in hf else 0)
            if heads:
                rows = int(t.shape[-1])  # GGUF dims are fastest-first: the last one counts rows
                if rows != heads * config.head_dim or config.head_dim % 2:
                    raise ModelLoadError(f"{path}: tensor {t.name} has {rows} rows, but the metadata's {heads} heads "
                                         f"x head_dim {config.head_dim} need {heads * config.head_dim}")
                w = _unpermute_any(w, heads)
        state[hf] = w
    if mapped is not None:
        _place_weights(state, mapped, config.tie_word_embeddings)
    return config, state, fields


def _place_weights(state: dict[str, Any], mapped: Any, tied: bool) -> None:
    """Copy the matrices a decode step reads out of the mapped file into one buffer in 2 MiB pages
    (`huge_pages`: a step streams them with 512x fewer TLB misses), packing Q4_K in 16-row panels where this
    process's int8 kernel reads them so (`kernels.backend.weight_panels`, `kernels.panels`). File order, and
    a matrix that followed the previous one back to back in the file (gate and up) follows it in the buffer
    too, so every pair that merged as views before (model/quant_layers.py `stack_quant`) still does; the
    others start on a 64-byte line. Each matrix's pages of the mapped file are dropped from this process right
    after its copy (MADV_DONTNEED: the bytes are resident once, never twice; they stay in the page cache). Not the
    embedding table unless tied to the output (a lookup reads one row a token; never packed), nor experts
    (stacked later).
    Without 2 MiB pages (`huge_pages.worth`: KVLM_HUGE_PAGES=0, not Linux, a model under 2 MiB) only the
    panel-packed matrices move, into plain memory.
    """
    import torch

    from kvlm.kernels import QuantTensor
    from kvlm.kernels.backend import weight_panels
    from kvlm.kernels.panels import pack, packable
    from kvlm.loader import huge_pages
    from kvlm.model.quant_layers import back_to_back

    panels = weight_panels()
    keys = [k for k, w in state.items() if isinstance(w, QuantTensor)
            and (tied or not k.endswith("embed_tokens.weight")) and ".experts." not in k]
    packed = {k for k in keys if panels and packable(state[k]) and not k.endswith("embed_tokens.weight")}
    huge = huge_pages.worth(sum(state[k].nbytes for k in keys))
    if not huge:
        keys = [k for k in keys if k in packed]
    if not keys:
        return
    offsets, end, prev = [], 0, None
    for k in keys:
        w = state[k]
        if prev is None or not back_to_back(prev, w):
            end = -(-end // 64) * 64
        offsets.append(end)
        end, prev = end + w.nbytes, w
    buf = huge_pages.empty(end) if huge else torch.empty(end, dtype=torch.uint8)
    for k, off in zip(keys, offsets):
        w = state[k]
        dst = buf[off:off + w.nbytes]
        if k in packed:
            state[k] = pack(w, dst)
        else:
            dst.view(w.data.shape).copy_(w.data)
            state[k] = QuantTensor(dst.view(w.data.shape), w.qtype, w.shape, panels=w.panels)
        _release(w.data, mapped)


def _release(t: Any, mapped: Any) -> None:
    """Drop the whole pages of t that lie in the file mapping `mapped` from this process."""
    from kvlm.loader.mapped_pages import drop_pages

    lo, p, n = mapped.data_ptr(), t.data_ptr(), t.numel()
    if lo <= p and p + n <= lo + mapped.numel():  # else a copy (the un-permuted q / k rows): freed with it
        drop_pages(p, p + n)


def _unpermute_any(w: Any, n_heads: int) -> Any:
    """unpermute_rope on a float tensor, or on a QuantTensor's byte rows (blocks run along K)."""
    import torch

    from kvlm.kernels import QuantTensor

    if isinstance(w, torch.Tensor):
        return unpermute_rope(w, n_heads)
    # The same row permutation in numpy: a plain single-threaded copy of ~200 KB, where torch's strided
    # uint8 copy wakes its thread pool and took ~7 ms per matrix on a busy 2-core machine.
    rows = w.data.numpy()  # (N, row_bytes) view of the mapped file
    n, rb = rows.shape
    out = np.ascontiguousarray(rows.reshape(n_heads, n // n_heads // 2, 2, rb).transpose(0, 2, 1, 3)).reshape(n, rb)
    return QuantTensor(torch.from_numpy(out), w.qtype, w.shape)
