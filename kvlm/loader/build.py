"""From a resolved model path to a ready model: checkpoint read, context decided, module built and loaded.

`Engine.__init__` only wires what this returns to the KV cache, the scheduler and the runner. The
steps, in order: read the checkpoint (`load_checkpoint`), decide the context length the engine
allows, build the module tree on the meta device (no random init of weights that are replaced), load
the weights, convert to the compute dtype and device, switch CPU projections to input-major layout,
and drop from the resident set the pages of the mapped file that the load read but the model never
will.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlm.config import ModelConfig
from kvlm.errors import ParameterError
from kvlm.kernels.backend import Backend, select_backend
from kvlm.loader import f32_blocks, load_checkpoint
from kvlm.loader.mapped_pages import release_unused
from kvlm.model.gemma3 import Gemma3ForCausalLM
from kvlm.model.llama import LlamaForCausalLM
from kvlm.model.quant_layers import weight_ranges
from kvlm.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("kvlm")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int  # the context this engine allows (<= the model's)
    backend: Backend  # which kernels serve it, and why (kernels/backend.py)


def context_length(requested: int | None, config: ModelConfig) -> int:
    """The context the engine allows: as requested (never above the model's), else min(model, 4096);
    capped at a model-wide sliding window (Mistral-style configs: their layers attend in full here, which
    equals sliding-window attention only within the window); models with per-layer windows (Gemma 3)
    attend within each layer's window and are not capped."""
    if requested is not None and requested > config.max_position_embeddings:
        raise ParameterError("max_model_len", f"max_model_len {requested} is greater than the model's "
                             f"maximum context (max_position_embeddings={config.max_position_embeddings})")
    n = requested or min(config.max_position_embeddings, 4096)
    if config.sliding_window and config.layer_windows is None and n > config.sliding_window:
        log.warning("kvlm: context capped at the model's sliding window of %d tokens", config.sliding_window)
        n = config.sliding_window
    return n


def load_model(path: Path, max_model_len: int | None, dtype: torch.dtype, device: torch.device, *,
               quantized: bool) -> LoadedModel:
    """quantized: GGUF weights stay in their block formats (the CPU `--dtype auto` path); otherwise every
    weight is dequantized to `dtype` at load (the dense path). Dense float32 on a CPU with the native
    kernels multiplies on the row kernel (`f32_blocks`), as `--dtype auto` does a safetensors folder's:
    its rows are bit-identical in any batch at any thread count, and its sums round less than BLAS's
    (scripts/experiments/dense_rows_error.py at f97df0a), which left Gemma 3's logits 1.5e-4 from transformers'."""
    config, state, tokenizer = load_checkpoint(path, quantized=quantized)
    backend = select_backend(device, dtype, config.head_dim)  # the engine's one kernel decision
    if not quantized and backend.native_rows:
        state = {k: f32_blocks(v) if isinstance(v, torch.Tensor) and v.ndim in (2, 3) else v for k, v in state.items()}
    n_ctx = context_length(max_model_len, config)
    cls = Gemma3ForCausalLM if config.model_type == "gemma3_text" else LlamaForCausalLM
    with torch.device("meta"):  # no random init of weights that load_weights replaces
        net = cls(config, n_ctx)
    net.load_weights(state)
    del state
    model = net.to(device=device, dtype=dtype).eval()
    for name, table in list(model.named_buffers()):  # RoPE tables stay float32 (positions need the precision)
        if name.startswith("rope_"):
            setattr(model, name, table.float())
    if device.type == "cpu":
        model.to_input_major()
    if quantized:  # pages of the mapped file(s) read at load but never by the model: out of RSS
        used = weight_ranges(model)
        for f in [path] if path.is_file() else [*path.glob("*.gguf"), *path.glob("*.safetensors")]:
            release_unused(f, used)
    return LoadedModel(model, config, tokenizer, n_ctx, backend)
