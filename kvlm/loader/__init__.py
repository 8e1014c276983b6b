"""Model loading: a name or path -> (`ModelConfig`, HF-named state dict, `Tokenizer`).

`registry` resolves aliases (pulling named models on first use); `gguf` and `safetensors` read the two
formats. Both produce the same HF-named float32 state dict, so the model code never sees a format.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlm.config import ModelConfig
from kvlm.errors import ModelLoadError, TokenizerError
from kvlm.loader.registry import DEFAULT_MODEL, resolve_model
from kvlm.tokenizer.templates import BUILTIN_TEMPLATES

if TYPE_CHECKING:  # torch and tokenizers load with the model, not with `kvlm kv-size` or `kvlm info`
    import torch

    from kvlm.tokenizer.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "f32_blocks", "load_checkpoint", "load_config", "resolve_model"]


def _gguf_file(path: Path) -> Path | None:
    if path.is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs and not (path / "config.json").is_file():
        return ggufs[0]
    return None


def load_checkpoint(path: str | os.PathLike,
                    quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a .gguf file or an HF folder (already resolved to a local path). quantized: GGUF weights
    stay in their block formats as `kernels.QuantTensor` views of the mapped file (see loader.gguf), and a
    folder's BF16/F16/F32 matrices in their width likewise (see loader.safetensors)."""
    import torch

    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"{p}: no such model file or folder")
    gg = _gguf_file(p)
    try:
        if gg is not None:
            from kvlm.loader.gguf import load_gguf
            from kvlm.tokenizer.cache import gguf_tokenizer

            config, state, fields = load_gguf(gg, quantized=quantized)
            tokenizer = gguf_tokenizer(gg, fields)  # cached next to the model file
            if tokenizer.chat_template is None and config.model_type in BUILTIN_TEMPLATES:
                tokenizer.use_builtin_template(*BUILTIN_TEMPLATES[config.model_type])
        else:
            from kvlm.loader.safetensors import load_hf_dir
            from kvlm.tokenizer.tokenizer import Tokenizer

            # quantized: 2-D BF16/F16/F32 weights stay in their width, views of the mapped shards; the rest
            # (3-D expert stacks) as float32 blocks. Both go to the native row kernel (a fixed order per output).
            config, state = load_hf_dir(p, in_width=quantized)
            if quantized:
                state = {k: f32_blocks(v) if isinstance(v, torch.Tensor) and v.ndim in (2, 3) else v
                         for k, v in state.items()}
            tokenizer = Tokenizer.from_hf_dir(p)
    except TokenizerError as e:
        raise ModelLoadError(f"{p}: bad tokenizer: {e}") from None
    return config, state, tokenizer


def f32_blocks(w: torch.Tensor) -> Any:
    """A dense float32 (N, K) weight as an F32 `QuantTensor` over the same bytes: the native row kernel
    then multiplies it, whose rows are bit-identical in any batch or chunk and whose sums (16 lanes, then a
    fixed tree) round less than BLAS's (`--dtype float32` on CPU takes it too, `loader.build`). A 3-D
    (E, N, K) tensor of stacked experts becomes an F32 `ExpertStack` likewise."""
    import torch

    from kvlm.kernels.ggml_types import GGMLQuantizationType
    from kvlm.kernels.quant_tensor import ExpertStack, QuantTensor

    w = w.float().contiguous()
    if w.ndim == 3:
        return ExpertStack(w.view(torch.uint8).reshape(*w.shape[:2], -1), GGMLQuantizationType.F32, tuple(w.shape))
    return QuantTensor(w.view(torch.uint8).reshape(w.shape[0], -1), GGMLQuantizationType.F32, tuple(w.shape))


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Only the config (no tensors dequantized): for `kvlm info` and `kvlm kv-size`."""
    p = Path(path)
    gg = _gguf_file(p)
    if gg is not None:
        from kvlm.loader.gguf import config_from_gguf, read_gguf, rope_factors

        reader, fields = read_gguf(gg)
        return config_from_gguf(fields, {t.name for t in reader.tensors}, rope_factors(reader))
    import json

    cfg = p / "config.json" if p.is_dir() else p
    try:
        return ModelConfig.from_hf_dict(json.loads(cfg.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg}: cannot read config ({e})") from None
