"""LoRA adapters served per request, never merged into the base: the adapter (`adapter`), the engine's
adapters by name (`registry`) and the per-row low-rank update of one step (`rows`). Reading adapter
files (PEFT safetensors, llama.cpp GGUF) is `kvlm.loader.lora`'s."""

from kvlm.lora.adapter import LoRAAdapter, LoRAPart, build_adapter
from kvlm.lora.registry import LoRARegistry, LoRARequest, parse_lora_spec
from kvlm.lora.rows import LoRARows

__all__ = ["LoRAAdapter", "LoRAPart", "LoRARegistry", "LoRARequest", "LoRARows", "build_adapter", "parse_lora_spec"]
