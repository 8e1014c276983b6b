"""LoRA adapter files -> `kvlm.lora.LoRAAdapter` for a loaded base model.

Two formats, never unpickled:

* PEFT folders: `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, rank_pattern /
  alpha_pattern) and `adapter_model.safetensors` with tensors named
  `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` (A: r x in) and `...lora_B.weight`
  (B: out x r). Each module's scale is alpha / r (alpha / sqrt(r) with rsLoRA), as PEFT computes it.
* llama.cpp's GGUF LoRA files (convert_lora_to_gguf.py): `general.type = adapter`, `adapter.type = lora`,
  `adapter.lora.alpha`, tensors `blk.N.attn_q.weight.lora_a` / `.lora_b` in the base's GGUF names; the
  converter permuted Q and K rows for RoPE as it does the base's, so B's rows are un-permuted here as the
  base's are (`gguf.unpermute_rope`). Scale alpha / r, or 1 when alpha is 0 (llama.cpp's rule).

What does not fit the base is one `LoRAError` line (`kvlm.lora.adapter.build_adapter` checks shapes).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ModelConfig
from kvlm.errors import LoRAError, ModelLoadError
from kvlm.loader.gguf import (
    _ARCH_TO_MODEL_TYPE,
    PERMUTED_QK,
    dequantize_tensor,
    gguf_to_hf_name,
    read_gguf,
    unpermute_rope,
)
from kvlm.lora.adapter import ATTENTION_MODULES, TARGETS, LoRAAdapter, LoRAPart, build_adapter

# PEFT tensor names: the HF module path, then lora_A / lora_B (an adapter name may sit before `.weight`).
_PEFT_RE = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
_GGUF_RE = re.compile(r"^(blk\.\d+\.[a-z_]+\.weight)\.lora_([ab])$")


def load_lora(name: str, path: str | Path, config: ModelConfig, adapter_id: int, scale: float = 1.0) -> LoRAAdapter:
    """Read the adapter at `path` (a PEFT folder, its adapter_config.json, or a GGUF file) for `config`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise LoRAError(f"LoRA adapter {name!r}: no such file or folder: {p}")
    if not math.isfinite(scale):
        raise LoRAError(f"LoRA adapter {name!r}: scale {scale} is not a finite number")
    if p.is_file() and p.name == "adapter_config.json":
        p = p.parent
    if p.is_dir():
        parts = _peft_parts(name, p, config)
    elif p.suffix == ".gguf" or _magic(p) == b"GGUF":
        parts = _gguf_parts(name, p, config)
    else:
        raise LoRAError(f"LoRA adapter {name!r}: {p} is neither a PEFT folder (adapter_config.json) nor a GGUF file")
    return build_adapter(name, adapter_id, str(p), parts, config, scale)


def _magic(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(4)


def _peft_parts(name: str, folder: Path, config: ModelConfig) -> dict[tuple[int, str], LoRAPart]:
    cfg_path, st_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no adapter_config.json")
    if not st_path.is_file():
        pickled = (folder / "adapter_model.bin").is_file()
        raise LoRAError(f"LoRA adapter {name!r}: {folder} has no adapter_model.safetensors"
                        + (" (adapter_model.bin is a pickle: kvlm never unpickles weights)" if pickled else ""))
    try:
        acfg = json.loads(cfg_path.read_text())
        assert isinstance(acfg, dict)
    except (ValueError, AssertionError, UnicodeDecodeError):
        raise LoRAError(f"LoRA adapter {name!r}: {cfg_path} is not a JSON object") from None
    if acfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {acfg.get('peft_type')!r} is not LORA")
    if acfg.get("use_dora"):
        raise LoRAError(f"LoRA adapter {name!r}: DoRA adapters are not supported")
    if acfg.get("bias", "none") != "none" or acfg.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {name!r}: bias or modules_to_save would change base weights; not supported")
    if acfg.get("fan_in_fan_out"):
        raise LoRAError(f"LoRA adapter {name!r}: fan_in_fan_out adapters (GPT-2 Conv1D) do not fit this base")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(st_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {st_path} is not a readable safetensors file "
                        f"({str(e)[:120]})") from None
    ab: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PEFT_RE.match(key)
        if m is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA weight of a projection kvlm can "
                            f"adapt ({', '.join(TARGETS)})")
        slot = ab.setdefault((int(m.group(1)), m.group(2)), {})
        if m.group(3) in slot:
            raise LoRAError(f"LoRA adapter {name!r}: two lora_{m.group(3)} tensors for "
                            f"layers.{m.group(1)}.{m.group(2)}")
        slot[m.group(3)] = t
    alpha = float(acfg.get("lora_alpha", acfg.get("r", 8)))
    rslora = bool(acfg.get("use_rslora"))
    parts = {}
    for (layer, module), slot in ab.items():
        if set(slot) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name!r}: layers.{layer}.{module} has lora_{''.join(slot)} only")
        r = slot["A"].shape[0]
        a = _pattern(acfg.get("alpha_pattern") or {}, layer, module, alpha)
        parts[layer, module] = LoRAPart(slot["A"], slot["B"], a / (math.sqrt(r) if rslora else r))
    return parts


def _pattern(patterns: dict[str, Any], layer: int, module: str, default: float) -> float:
    """PEFT's alpha_pattern: a key matches a module path ending in it (or a regex over the path)."""
    block = "self_attn" if module in ATTENTION_MODULES else "mlp"
    path = f"model.layers.{layer}.{block}.{module}"
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?{key}", path) or path.endswith(key):
            return float(value)
    return default


def _gguf_parts(name: str, path: Path, config: ModelConfig) -> dict[tuple[int, str], LoRAPart]:
    try:
        reader, fields = read_gguf(path)
    except ModelLoadError as e:
        raise LoRAError(f"LoRA adapter {name!r}: {e}") from None
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a GGUF LoRA adapter (general.type "
                        f"{fields.get('general.type')!r}, adapter.type {fields.get('adapter.type')!r})")
    arch = fields.get("general.architecture")
    if _ARCH_TO_MODEL_TYPE.get(str(arch)) not in (config.model_type, None) and not (
            arch == "llama" and config.model_type == "mistral"):
        raise LoRAError(f"LoRA adapter {name!r}: made for architecture {arch!r}, the base is {config.model_type!r}")
    alpha = float(fields.get("adapter.lora.alpha", 0.0) or 0.0)
    ab: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        m = _GGUF_RE.match(t.name)
        hf = gguf_to_hf_name(m.group(1), str(arch)) if m else None
        if m is None or hf is None:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {t.name} is not a LoRA weight of a projection kvlm "
                            f"can adapt")
        parts = hf.split(".")  # model.layers.N.(self_attn|mlp).module.weight
        key = (int(parts[2]), parts[4])
        slot = ab.setdefault(key, {})
        if m.group(2) in slot:
            raise LoRAError(f"LoRA adapter {name!r}: two {t.name} tensors")
        try:
            slot[m.group(2)] = dequantize_tensor(t)
        except ModelLoadError as e:
            raise LoRAError(f"LoRA adapter {name!r}: {e}") from None
    out = {}
    for (layer, module), slot in ab.items():
        if set(slot) != {"a", "b"}:
            raise LoRAError(f"LoRA adapter {name!r}: blk.{layer} {module} has lora_{''.join(slot)} only")
        a, b = slot["a"], slot["b"]
        if arch in PERMUTED_QK and module in ("q_proj", "k_proj") and b.shape[0] % 2 == 0:
            heads = config.num_attention_heads if module == "q_proj" else config.num_key_value_heads
            if b.shape[0] == heads * config.head_dim:  # else build_adapter reports the shape
                b = unpermute_rope(b, heads)
        r = a.shape[0]
        out[layer, module] = LoRAPart(a, b, alpha / r if alpha else 1.0)
    return out
