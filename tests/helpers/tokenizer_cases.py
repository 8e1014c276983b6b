"""Tokenizer cases shared by tests/tokenizer and scripts/record_llama_cpp_ids.py: a handmade sentencepiece
vocab (and its GGUF file), the texts the sentencepiece and pre-tokenizer tests encode, and llama.cpp's ids
for them (tests/data/tokenizer/llama_cpp_ids.json, recorded by that script: llama.cpp is the reference a
GGUF file's tokenizer is defined by)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LLAMA_CPP_IDS = Path(__file__).parents[1] / "data" / "tokenizer" / "llama_cpp_ids.json"

# The sentencepiece texts: the first four are where transformers' GGUF tokenizer parts from llama.cpp.
SPM_TEXTS = [" hello", "  hello world", "</s>hello", "hello</s> world",
             "hello world", "hello  world\nhé 😀", "[INST] hello [/INST]", "wor ld</s>", "\nhello"]
SPM_TRANSFORMERS_DIFFERS = SPM_TEXTS[:4]

PRE_CORPUS = ["Hello world, it's 2024!\n\t日本 😀 x+=1", "I'M HERE they'll   12345678 go\r\n\n  end",
              "CamelCaseWord über-naïve 3.14159 ", "don't  stop\n\n\nnow?! ...  ",
              "你好世界，ＡＢＣ１２３ émoji 🎉🎉 tabs\t\tand", "a/b/c//d   \n  x"]
# tokenizer.ggml.pre values of byte-level BPE files; transformers has no split regex for the second six.
PRE_TOKENIZERS = ["gpt-2", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o"]
PRE_NO_HF_SPLIT = ["default", "falcon", "deepseek-coder", "deepseek-v3", "bloom", "smollm"]
# The vocab and merges the pre-tokenizers' ids are taken with: SmolLM2-135M's (49,152 tokens), whose
# merges cross the places where the pre-tokenizers' regexes differ (digits, spaces, apostrophes, CJK).
BPE_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")


def spm_fields(**extra: Any) -> dict[str, Any]:
    """A Llama-2-style sentencepiece vocab: <unk>/<s>/</s>, 256 byte-fallback pieces, scored pieces."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "ll", "he", "▁h", "▁he", "llo", "▁hello", "or", "▁w",
              "▁wor", "ld", "▁world", "[", "]", "I", "N", "S", "T", "/", "IN", "ST", "INST", "[INST", "[INST]",
              "▁[INST]"]
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": specials + pieces,
        "tokenizer.ggml.scores": [0.0] * len(specials) + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
                                   "{% endfor %}",
    }
    return {**fields, **extra}


def write_spm_gguf(path: Path) -> Path:
    """spm_fields' vocab as a GGUF file (one zero embedding tensor), as transformers and llama.cpp read it."""
    import gguf
    import numpy

    fields = spm_fields()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_scores(fields["tokenizer.ggml.scores"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1), writer.add_eos_token_id(2), writer.add_unk_token_id(0)
    n_vocab = len(fields["tokenizer.ggml.tokens"])
    writer.add_tensor("token_embd.weight", numpy.zeros((n_vocab, 4), dtype=numpy.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return path


def bpe_fields(smollm_fields: dict[str, Any], pre: str) -> dict[str, Any]:
    """SmolLM2's byte-level BPE vocab and merges under the pre-tokenizer `pre`, no chat template."""
    return {**{k: smollm_fields[k] for k in BPE_KEYS}, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre}


def read_gguf_fields(path: str | Path) -> dict[str, Any]:
    """All GGUF metadata of `path` as plain Python values keyed by GGUF key name."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}


def llama_cpp_ids() -> dict[str, Any]:
    return json.loads(LLAMA_CPP_IDS.read_text())
