"""Tests for kvlm.loader: GGUF and safetensors give the same HF-named weights, the loaded model matches
transformers, every supported GGUF tensor type round-trips exactly, broken inputs fail with one readable
`ModelLoadError` line, and the registry resolves names without touching the network.

All models are tiny and random (tests/helpers/tiny_models.py) and written once per session.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import tiny_models
import torch
from quantize import KQUANT_F16_FIELDS, can_quantize, real_quantize, synthetic_quantize
from tiny_models import hf_reference_model, random_state_dict, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from kvlm import paths
from kvlm.errors import KvlmError, ModelLoadError, UnsupportedModelError
from kvlm.llm import LLM
from kvlm.loader import load_checkpoint, load_config, registry, resolve_model
from kvlm.loader.gguf import SUPPORTED_TENSOR_TYPES, dequantize_tensor

IDS = [5, 17, 104, 200, 33, 12, 250, 7, 99, 101, 3, 66]  # a 12-token prompt (byte ids and merges)
ATOL = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# variant -> (model_type, extra config fields, seed)
VARIANTS: dict[str, tuple[str, dict[str, Any], int]] = {
    "llama": ("llama", {}, 1),
    "qwen2": ("qwen2", {}, 2),  # q/k/v biases
    "qwen3": ("qwen3", {}, 3),  # q/k RMSNorm
    "mistral": ("mistral", {}, 4),  # written as GGUF arch "llama", like llama.cpp does
    "llama_untied": ("llama", {"tie_word_embeddings": False}, 5),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE}, 6),
}


@dataclasses.dataclass
class Tiny:
    cfg: dict[str, Any]
    state: dict[str, torch.Tensor]
    root: Path
    _ref_logits: torch.Tensor | None = None

    def gguf(self) -> Path:
        p = self.root / "model.gguf"
        if not p.exists():
            write_tiny_gguf(p, self.cfg, self.state)
        return p

    def hf(self) -> Path:
        p = self.root / "hf"
        if not p.exists():
            write_tiny_hf_dir(p, self.cfg, self.state)
        return p

    def ref_logits(self) -> torch.Tensor:
        """Last-position logits of the transformers model with the same weights."""
        if self._ref_logits is None:
            self._ref_logits = reference_logits(self.cfg, self.state)
        return self._ref_logits


def reference_logits(cfg: dict[str, Any], state: dict[str, torch.Tensor], ids: list[int] = IDS) -> torch.Tensor:
    # deepcopy: transformers adds keys (rope_theta) to the rope_scaling dict it is given
    ref = hf_reference_model(copy.deepcopy(cfg), state)
    ref_sd = ref.state_dict()
    # load_state_dict(strict=False) would hide a name mismatch: make sure the reference really has our weights
    assert all(torch.equal(ref_sd[k], v) for k, v in state.items()), "reference model did not take the weights"
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1].float()


def kvlm_logits(path: Path, ids: list[int] = IDS) -> torch.Tensor:
    """kvlm's logits for the last prompt position after one (prefill) step."""
    llm = LLM(str(path), device="cpu")
    e = llm.llm_engine
    e.add_request(list(ids))
    e.step(keep_logits=True)
    assert e.last_result.logits is not None
    return e.last_result.logits[0]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Tiny] = {}

    def get(variant: str) -> Tiny:
        if variant not in cache:
            model_type, extra, seed = VARIANTS[variant]
            cfg = tiny_config(model_type, **copy.deepcopy(extra))
            cache[variant] = Tiny(cfg, random_state_dict(cfg, seed), tmp_path_factory.mktemp(variant))
        return cache[variant]

    return get


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == torch.float32, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k].float()), f"{k} differs"


# ------------------------------------------------------------------------------ GGUF == HF == transformers


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "mistral", "llama_untied"])
def test_gguf_and_hf_folder_load_the_same_model(tiny, variant: str) -> None:
    t = tiny(variant)
    gcfg, gstate, gtok = load_checkpoint(t.gguf())
    hcfg, hstate, htok = load_checkpoint(t.hf())
    # Both equal the original weights exactly (F32 GGUF: the Q/K permutation is undone bit for bit).
    assert_same_state(gstate, t.state)
    assert_same_state(hstate, t.state)
    # Same config (a mistral GGUF says "llama": llama.cpp writes it under that architecture).
    gd, hd = dataclasses.asdict(gcfg), dataclasses.asdict(hcfg)
    if variant == "mistral":
        assert gd.pop("model_type") == "llama" and hd.pop("model_type") == "mistral"
    # GGUF stores floats as float32: compare those with a tolerance, everything else exactly.
    for k in ("rms_norm_eps", "rope_theta"):
        assert math.isclose(gd.pop(k), hd.pop(k), rel_tol=1e-6), k
    assert gd == hd
    assert hcfg.tie_word_embeddings == t.cfg["tie_word_embeddings"]
    assert hcfg.attention_bias == (variant == "qwen2")
    assert hcfg.qk_norm == (variant == "qwen3")
    text = "hello world <|im_start|>user\nhi<|im_end|>"
    assert gtok.encode(text) == htok.encode(text)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3", "mistral", "llama_untied"])
def test_logits_match_transformers(tiny, variant: str, fmt: str) -> None:
    t = tiny(variant)
    got = kvlm_logits(t.gguf() if fmt == "gguf" else t.hf())
    ref = t.ref_logits()
    assert got.shape == ref.shape == (t.cfg["vocab_size"],)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_hf_folder(tiny) -> None:
    t = tiny("llama3_rope")
    cfg, _, _ = load_checkpoint(t.hf())
    assert cfg.rope_scaling["rope_type"] == "llama3"
    got = kvlm_logits(t.hf())
    torch.testing.assert_close(got, t.ref_logits(), atol=ATOL, rtol=0)
    # The scaling must actually matter for this prompt, else the test above would prove nothing.
    unscaled = reference_logits(tiny_config("llama"), t.state)
    assert (unscaled - t.ref_logits()).abs().max() > 1e-2


def llama3_rope_freqs(cfg: dict[str, Any]) -> torch.Tensor:
    """llama.cpp's `rope_freqs.weight` for llama3 scaling (per-frequency divisors of inv_freq)."""
    rs, dim = cfg["rope_scaling"], cfg["head_dim"]
    old = rs["original_max_position_embeddings"]
    lo_wl, hi_wl = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * cfg["rope_theta"] ** (i / dim)
        if wavelen < hi_wl:
            out.append(1.0)
        elif wavelen > lo_wl:
            out.append(rs["factor"])
        else:
            smooth = (old / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return torch.tensor(out, dtype=torch.float32)


def test_llama3_rope_freqs_tensor_in_gguf(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama3 GGUF carries scaling as a `rope_freqs.weight` tensor, not as metadata."""
    t = tiny("llama3_rope")
    name = tiny_models._gguf_name
    monkeypatch.setattr(tiny_models, "_gguf_name", lambda hf: "rope_freqs.weight" if hf == "rope_freqs" else name(hf))
    cfg = {k: v for k, v in t.cfg.items() if k != "rope_scaling"}  # the GGUF has no scaling metadata
    path = write_tiny_gguf(tmp_path / "llama3.gguf", cfg, {**t.state, "rope_freqs": llama3_rope_freqs(t.cfg)})
    got = kvlm_logits(path)
    torch.testing.assert_close(got, t.ref_logits(), atol=ATOL, rtol=0)


def test_sharded_safetensors_folder(tiny, tmp_path: Path) -> None:
    t = tiny("llama")
    path = write_tiny_hf_dir(tmp_path / "sharded", t.cfg, t.state, shards=3)
    assert len(list(path.glob("model-*-of-00003.safetensors"))) == 3
    assert (path / "model.safetensors.index.json").is_file()
    _, state, _ = load_checkpoint(path)
    assert_same_state(state, t.state)
    torch.testing.assert_close(kvlm_logits(path), t.ref_logits(), atol=ATOL, rtol=0)


def test_folder_holding_one_gguf_file(tiny, tmp_path: Path) -> None:
    t = tiny("qwen2")
    d = tmp_path / "ggufdir"
    d.mkdir()
    (d / "x.gguf").write_bytes(t.gguf().read_bytes())
    _, state, _ = load_checkpoint(d)
    assert_same_state(state, t.state)


def test_load_config_matches_load_checkpoint(tiny) -> None:
    t = tiny("qwen3")
    for path in (t.gguf(), t.hf()):
        assert load_config(path) == load_checkpoint(path)[0]


# ------------------------------------------------------------------------- tensor types: exact round trip

@pytest.fixture(scope="session")
def quant_model() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    # K-quants work on 256-value super-blocks: every row length (hidden, intermediate, heads*head_dim)
    # is a multiple of 256. Untied so that output.weight is quantized too.
    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=False)
    return cfg, random_state_dict(cfg, seed=11)


@pytest.mark.parametrize("tensor_type", sorted(SUPPORTED_TENSOR_TYPES))
def test_tensor_type_round_trip(quant_model, tensor_type: str, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded weight == dequantize(quantize(original)): names, un-permutation and dequantization exact."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    quantize = real_quantize
    if not can_quantize(qtype):
        if tensor_type not in KQUANT_F16_FIELDS:
            pytest.skip(f"the gguf package cannot quantize {tensor_type} and this test has no synthetic "
                        "block layout for it")
        # gguf's numpy code only dequantizes K-quants: write synthetic blocks instead of skipping.
        quantize = synthetic_quantize
        monkeypatch.setattr(gguf.quants, "quantize", synthetic_quantize)
    cfg, state = quant_model
    path = write_tiny_gguf(tmp_path / f"{tensor_type}.gguf", cfg, state, tensor_type=tensor_type)
    reader = gguf.GGUFReader(str(path))
    written = {t.name: t.tensor_type.name for t in reader.tensors}
    assert written["blk.0.attn_q.weight"] == tensor_type and written["output_norm.weight"] == "F32"

    _, loaded, _ = load_checkpoint(path)
    assert sorted(loaded) == sorted(state)
    for name, w in state.items():
        a = w.numpy()
        expected = a if a.ndim == 1 else gguf.quants.dequantize(quantize(a, qtype), qtype).astype(np.float32)
        assert loaded[name].dtype == torch.float32
        assert loaded[name].shape == w.shape, name
        assert np.array_equal(loaded[name].numpy(), expected), f"{name} ({tensor_type}) differs"
    if quantize is real_quantize:  # a real quantizer stays close to the original
        err = max(float((loaded[k] - state[k]).abs().max() / state[k].abs().max()) for k in state)
        assert err < 0.5, err


def test_k_quant_needs_256_wide_rows() -> None:
    """Why the round-trip model is 256 wide: K-quant rows must be whole 256-value super-blocks."""
    assert all(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]][0] == 256 for t in KQUANT_F16_FIELDS)
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 32


# ------------------------------------------------------------------------------------------- errors


def assert_one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg, repr(msg)
    for w in words:
        assert w.lower() in msg.lower(), f"{w!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="session")
def good_gguf(tiny) -> bytes:
    return tiny("llama").gguf().read_bytes()


def _write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_missing_file_through_llm_and_resolve(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError) as e:
        LLM(str(missing))
    assert_one_line(e, str(missing))
    with pytest.raises(ModelLoadError):
        resolve_model(str(missing))
    with pytest.raises(ModelLoadError) as e:
        load_config(missing)
    assert_one_line(e, "nope.gguf")


def test_missing_file_load_checkpoint_message(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(missing)
    msg = assert_one_line(e, "nope.gguf").replace(str(missing), "<path>")
    assert any(w in msg.lower() for w in ("no such", "not found", "does not exist", "missing")), msg


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, b""))
    assert_one_line(e, "not a GGUF file", "0 bytes")


def test_bad_magic(tmp_path: Path, good_gguf: bytes) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, b"GGML" + good_gguf[4:]))
    assert_one_line(e, "not a GGUF file", "magic")


@pytest.mark.parametrize("version", [1, 4, 0xFFFFFFFF])
def test_unsupported_gguf_version(tmp_path: Path, good_gguf: bytes, version: int) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, good_gguf[:4] + struct.pack("<I", version) + good_gguf[8:]))
    assert_one_line(e, f"unsupported GGUF version {version}")


@pytest.mark.parametrize("field", ["tensors", "metadata keys"])
def test_absurd_counts_in_header(tmp_path: Path, good_gguf: bytes, field: str) -> None:
    at = 8 if field == "tensors" else 16
    data = good_gguf[:at] + struct.pack("<Q", 2**40) + good_gguf[at + 8:]
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, data))
    assert_one_line(e, "corrupt GGUF header", str(2**40))


@pytest.mark.parametrize("heads", [260, 8])
def test_head_count_that_does_not_fit_the_weights(tmp_path: Path, good_gguf: bytes, heads: int) -> None:
    """Metadata whose head count disagrees with the Q weight's rows (found by the property test: it
    crashed in the RoPE un-permute with a torch shape error) is one sentence naming the tensor."""
    key = b"llama.attention.head_count\x04\x00\x00\x00"
    at = good_gguf.index(key) + len(key)
    data = good_gguf[:at] + struct.pack("<I", heads) + good_gguf[at + 4:]
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, data))
    assert_one_line(e, "bad.gguf", "attn_q", f"{heads} heads")


@pytest.mark.parametrize("cut", [0.5, 10, 24, 200, 3000, 0.25, -1])
def test_truncated_gguf(tmp_path: Path, good_gguf: bytes, cut: float) -> None:
    n = int(len(good_gguf) * cut) if isinstance(cut, float) else cut % len(good_gguf)
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, good_gguf[:n]))
    assert_one_line(e, "bad.gguf")


def test_truncated_gguf_says_so(tmp_path: Path, good_gguf: bytes) -> None:
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(_write(tmp_path, good_gguf[: len(good_gguf) // 2]))
    assert_one_line(e, "truncated")


@pytest.mark.parametrize("arch", ["falcon", "gpt2"])
def test_unsupported_gguf_architecture(tmp_path: Path, arch: str) -> None:
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch)
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(path)
    assert_one_line(e, "unsupported architecture", repr(arch), "llama")
    with pytest.raises(UnsupportedModelError):
        load_config(path)


def _zero_blocks(a: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return np.zeros((*a.shape[:-1], a.shape[-1] // block * nbytes), np.uint8)


@pytest.mark.parametrize("tensor_type", ["IQ4_NL", "Q8_1"])
def test_unsupported_tensor_type_in_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tensor_type: str) -> None:
    """gguf cannot quantize these, but GGUFWriter writes raw blocks of any type: zero blocks will do."""
    assert tensor_type not in SUPPORTED_TENSOR_TYPES
    monkeypatch.setattr(gguf.quants, "quantize", _zero_blocks)
    cfg = tiny_config(hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_tiny_gguf(tmp_path / "iq.gguf", cfg, tensor_type=tensor_type)
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(path)
    assert_one_line(e, "unsupported type", tensor_type, "token_embd.weight")


def test_dequantize_tensor_rejects_unsupported_type() -> None:
    class FakeTensor:
        name = "blk.0.attn_q.weight"
        tensor_type = gguf.GGMLQuantizationType.IQ2_XXS
        shape = np.array([256, 4])
        data = np.zeros((4, 66), np.uint8)

    with pytest.raises(UnsupportedModelError) as e:
        dequantize_tensor(FakeTensor())
    assert_one_line(e, "IQ2_XXS", "blk.0.attn_q.weight")


@pytest.fixture
def hf_copy(tiny, tmp_path: Path):
    """A fresh copy of the tiny llama HF folder to break."""
    src = tiny("llama").hf()

    def make(name: str = "model") -> Path:
        dst = tmp_path / name
        dst.mkdir()
        for f in src.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        return dst

    return make


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def test_hf_folder_without_config(hf_copy) -> None:
    p = hf_copy()
    (p / "config.json").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "no config.json")


def test_hf_folder_invalid_json(hf_copy) -> None:
    p = hf_copy()
    (p / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "config.json", "invalid config")


@pytest.mark.parametrize("archs, named", [(["GPT2LMHeadModel"], "GPT2LMHeadModel"), (None, "gpt2")])
def test_hf_unsupported_model_type(hf_copy, archs: list[str] | None, named: str) -> None:
    p = hf_copy()
    _edit_config(p, model_type="gpt2", architectures=archs)
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(p)
    assert_one_line(e, "unsupported architecture", named, "gpt2")
    with pytest.raises(UnsupportedModelError):
        load_config(p)


def test_hf_missing_required_field(hf_copy) -> None:
    p = hf_copy()
    _edit_config(p, hidden_size=None)
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "config.json", "hidden_size")


def test_hf_non_numeric_config_value(hf_copy) -> None:
    p = hf_copy()
    _edit_config(p, num_attention_heads="four")
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "config.json")


def test_hf_unsupported_rope_scaling(hf_copy) -> None:
    p = hf_copy()
    _edit_config(p, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(UnsupportedModelError) as e:
        load_checkpoint(p)
    assert_one_line(e, "yarn")


def test_hf_pickle_only_is_refused(hf_copy, monkeypatch: pytest.MonkeyPatch) -> None:
    p = hf_copy()
    (p / "model.safetensors").rename(p / "pytorch_model.bin")

    def no_pickle(*a: Any, **k: Any) -> None:
        raise AssertionError("torch.load must never be called")

    monkeypatch.setattr(torch, "load", no_pickle)
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "pickle", "safetensors")


def test_hf_folder_without_weights(hf_copy) -> None:
    p = hf_copy()
    (p / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "safetensors")


def test_hf_missing_shard(tiny, tmp_path: Path) -> None:
    t = tiny("llama")
    p = write_tiny_hf_dir(tmp_path / "sharded", t.cfg, t.state, shards=3)
    (p / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "model-00002-of-00003.safetensors", "missing")


def test_hf_invalid_index(hf_copy) -> None:
    p = hf_copy()
    (p / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "index")


@pytest.mark.parametrize("how", ["garbage", "zeros", "half", "empty"])
def test_hf_corrupt_safetensors(hf_copy, how: str) -> None:
    p = hf_copy()
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"garbage": b"garbage!" * 50, "zeros": bytes(100), "half": data[: len(data) // 2], "empty": b""}[how])
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "model.safetensors", "corrupt")


def test_hf_missing_tokenizer(hf_copy) -> None:
    p = hf_copy()
    (p / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_checkpoint(p)
    assert_one_line(e, "tokenizer")


# ------------------------------------------------------------------------------------------ registry


def test_resolve_unknown_name_lists_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLM_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError) as e:
        resolve_model("no-such-model")
    msg = assert_one_line(e, "no-such-model")
    for alias in registry.MODELS:
        assert alias in msg
    assert not (tmp_path / "home").exists()  # nothing was pulled


def test_resolve_local_paths_as_given(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = tiny("llama")
    assert resolve_model(str(t.gguf())) == t.gguf()
    assert resolve_model(str(t.hf())) == t.hf()
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m.gguf").write_bytes(b"x")
    assert resolve_model("~/m.gguf") == tmp_path / "m.gguf"


def test_resolve_alias_uses_cache_without_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLM_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def no_download(*a: Any, **k: Any) -> None:
        raise AssertionError("must not run pip")

    monkeypatch.setattr(registry.subprocess, "run", no_download)
    dest = registry.model_path(registry.DEFAULT_MODEL)
    assert dest.is_relative_to(tmp_path)
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"cached")
    assert resolve_model(registry.DEFAULT_MODEL) == dest
    assert registry.pull(registry.DEFAULT_MODEL, quiet=True) == dest


def test_pull_unknown_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLM_HOME", str(tmp_path))
    with pytest.raises(KvlmError) as e:
        registry.pull("no-such-model", quiet=True)
    msg = assert_one_line(e, "no-such-model")
    assert registry.DEFAULT_MODEL in msg
    assert list(tmp_path.iterdir()) == []


def test_kvlm_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLM_HOME", str(tmp_path / "kh"))
    assert paths.kvlm_home() == tmp_path / "kh"
    assert registry.model_path(registry.DEFAULT_MODEL).parent == tmp_path / "kh" / "models" / registry.DEFAULT_MODEL
    monkeypatch.delenv("KVLM_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert paths.kvlm_home() == tmp_path / ".cache" / "kvlm"


def test_ggml_type_table_matches_the_gguf_package() -> None:
    """kvlm.kernels.ggml_types (kept so that loading never imports gguf and its yaml) equals gguf's constants."""
    import gguf

    from kvlm.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

    ours = {t.name: int(t) for t in GGMLQuantizationType}
    theirs = {t.name: int(t) for t in gguf.GGMLQuantizationType}
    assert {k: v for k, v in theirs.items() if k in ours} == ours
    assert {t.name: s for t, s in GGML_QUANT_SIZES.items()} == {
        t.name: s for t, s in gguf.GGML_QUANT_SIZES.items() if t.name in ours}


def test_generate_does_not_import_gguf_or_yaml(tiny_gguf) -> None:
    """The run path reads GGUF with kvlm's own parser and type table: no gguf / yaml import (0.1 s)."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvlm.cli.main import main\n"
            f"main(['-q', 'generate', {str(tiny_gguf)!r}, 'hi', '--max-tokens', '2', '--dtype', 'auto'])\n"
            "print('imported', 'gguf' in sys.modules, 'yaml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "imported False False" in out.stdout
