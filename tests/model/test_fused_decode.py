"""The fused decode step (kvlm/fused_decode.py, csrc/decode.cpp) against the module path it replaces.

* On random cache contents and a ragged batch: the fused step's final hidden states equal the module
  path's (model.forward on the same paged cache) bit for bit, on float32, float16 and bfloat16 caches,
  and it writes the same K/V bits; a sequence's result is bit-identical alone and inside the batch.
* Through the engine, on tiny quantized GGUFs of the llama, qwen2 (q/k/v bias), qwen3 (q/k norm), phi3
  (fused q/k/v and gate/up tensors, LongRoPE's scaled cos / sin), Phi-4-mini (RoPE on half of each head),
  smollm3 (a layer without RoPE) and granite (multipliers) families, a head_dim of 96 (whose
  attention scale 96 ** -0.5 rounds differently from 1 / sqrtf(96)), and the mixture-of-experts
  Qwen3-MoE (Q8_0), OLMoE (Q4_0: q/k norms over the whole projection) and Mixtral (Q4_K experts)
  (tests/helpers/tiny_moe.py): the same greedy tokens and the same logits bits with and without fusion.
* Where it must not run (float32 reference path, contiguous cache, KVLM_FUSED_DECODE=0) the runner
  keeps the module path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deps import need_native
from engine_runs import random_prompts, run_engine
from tiny_models import longrope, tiny_config, write_tiny_gguf
from tiny_moe import moe_config, moe_state_dict, write_moe_gguf

from kvlm import EngineConfig
from kvlm.attention.metadata import AttentionMetadata, StepKind
from kvlm.attention.paged import paged_rows
from kvlm.engine.engine import Engine
from kvlm.kernels import native
from kvlm.model.fused_decode import FusedDecoder


@pytest.fixture(autouse=True)
def _native() -> None:
    need_native("the fused decode step is native")


FAMILIES = {"llama": {}, "qwen2": {"attention_bias": True}, "qwen3": {}, "phi3": {}, "smollm3": {}, "granite": {},
            "phi4mini": {"partial_rotary_factor": 0.5, "rope_scaling": longrope(8, 64)}, "llama-d96": {"head_dim": 96}}
# mixture of experts: family -> the weight format the test writes (routed MLPs run csrc/moe.cpp in both paths)
MOE = {"qwen3_moe": "Q8_0", "olmoe": "Q4_0", "mixtral": "Q4_K"}


@pytest.fixture(scope="module", params=[*FAMILIES, *MOE])
def family_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param in MOE:
        fmt = MOE[request.param]
        root = tmp_path_factory.mktemp("fused-moe")
        if fmt.endswith("_K"):  # rows of whole 256-value super-blocks; gguf cannot quantize K-quants
            import gguf
            from quantize import synthetic_quantize

            cfg = moe_config(request.param, hidden_size=256, head_dim=64, intermediate_size=256)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(gguf.quants, "quantize", synthetic_quantize)
                return write_moe_gguf(root / "tiny.gguf", cfg, moe_state_dict(cfg), tensor_type=fmt)
        cfg = moe_config(request.param)
        return write_moe_gguf(root / "tiny.gguf", cfg, moe_state_dict(cfg), tensor_type=fmt)
    model_type = {"phi4mini": "phi3", "llama-d96": "llama"}.get(request.param, request.param)
    cfg = tiny_config(model_type, tie_word_embeddings=False, **FAMILIES[request.param])
    return write_tiny_gguf(tmp_path_factory.mktemp("fused") / f"tiny-{request.param}.gguf", cfg, tensor_type="Q8_0")


def _decode_meta(lens: list[int], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    """Metadata of a decode-only step: sequence b's new token sits at position lens[b] - 1."""
    pos = [n - 1 for n in lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, pos)]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        kind=StepKind.DECODE, positions=torch.tensor(pos), slots=(torch.tensor(slots),),
        tables=(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),),
        query_lens=(1,) * len(lens), seq_lens=tuple(lens), logits_indices=torch.arange(len(lens)),
        attn=paged_rows(torch.tensor(pos), [1] * len(lens), lens, [0] * len(lens)))


def _fill(engine: Engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in engine.kv_cache.k + engine.kv_cache.v:
        t.copy_(torch.randn(t.shape, generator=g))


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["auto", "float16", "bfloat16"])
def test_fused_step_equals_module_path_and_is_batch_invariant(family_gguf: Path, kv: str) -> None:
    """Bit for bit: both paths run the same native row kernels, element-wise functions (elementwise.h) and
    paged attention, in the same order, and round the new K/V to the cache's type alike."""
    engine = Engine(family_gguf, EngineConfig(dtype="auto", block_size=4, kv_cache_dtype=kv), quiet=True)
    fused = engine.runner.fused
    assert isinstance(fused, FusedDecoder)
    bs = engine.kv_cache.block_size
    lens = [1, 7, 30, 12]
    tables = [[0], [1, 2], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13]]
    ids = torch.tensor([5, 17, 200, 3])
    meta = _decode_meta(lens, tables, bs)

    _fill(engine, 0)
    ref = engine.model(ids, meta.positions, engine.kv_cache, meta).clone()  # module path
    kv_ref = [t.clone() for t in (*engine.kv_cache.k, *engine.kv_cache.v)]
    _fill(engine, 0)
    out = fused(ids, meta, engine.kv_cache).clone()
    assert torch.equal(out, ref), f"max |diff| {float((out - ref).abs().max()):.3g}"
    for a, b in zip((*engine.kv_cache.k, *engine.kv_cache.v), kv_ref, strict=True):  # the new tokens' K (after RoPE), V
        assert a.dtype == engine.kv_cache_dtype and torch.equal(a, b)

    for b in range(len(lens)):  # alone == in the batch, bit for bit
        _fill(engine, 0)
        alone = fused(ids[b : b + 1], _decode_meta([lens[b]], [tables[b]], bs), engine.kv_cache)
        assert torch.equal(alone[0], out[b]), f"sequence {b} differs alone"


def test_engine_tokens_with_and_without_fusion(family_gguf: Path) -> None:
    prompts = random_prompts(5, 11, lo=2, hi=40)
    cfg = EngineConfig(dtype="auto", block_size=4, max_num_batched_tokens=32)
    fused_engine = Engine(family_gguf, cfg, quiet=True)
    assert fused_engine.runner.fused is not None
    out, lout = run_engine(fused_engine, prompts)
    module_engine = Engine(family_gguf, cfg, quiet=True)
    module_engine.runner.fused = None
    ref, lref = run_engine(module_engine, prompts)
    assert out == ref
    for i in ref:
        assert torch.equal(torch.stack(lout[i]), torch.stack(lref[i])), f"prompt {i}"


VECTOR_ISAS = [i for i in native.ISAS if i != "scalar"]  # the x86 scalar unit has no FMA: bits of its own


@pytest.mark.parametrize(("head_dim", "fmt", "kv"), [(16, "Q8_0", "auto"), (64, "Q8_0", "auto"),
                                                   (64, "Q8_0", "int8"), (64, "Q4_0", "int4")])
def test_engine_same_bits_on_every_vector_isa(tmp_path: Path, head_dim: int, fmt: str, kv: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine (prefill chunks, the fused decode step), every vector ISA path this CPU has gives
    the same tokens and logits bits, so a model's output does not depend on whether an AVX2 or an AVX-512
    machine runs it. GQA 6 / 2 at head_dim 64 is SmolLM2's shape of attention (AVX2's 8-lane halves),
    16 the generic one. tests/kernels/test_paged_attention.py holds attention alone to it; the matmul
    contracts are the same on every unit."""
    have = [i for i in VECTOR_ISAS if native.isa_available(i)]
    if len(have) < 2:
        pytest.skip(f"one vector ISA path here ({have}): nothing to compare")
    cfg = tiny_config("llama", tie_word_embeddings=False, head_dim=head_dim, num_attention_heads=6)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", cfg, tensor_type=fmt)
    prompts = random_prompts(4, 23, lo=2, hi=40)
    ecfg = EngineConfig(dtype="auto", block_size=4, max_num_batched_tokens=32, kv_cache_dtype=kv)
    runs = {}
    try:
        for isa in have:
            monkeypatch.setenv(native.ENV_ISA, isa)
            native.refresh()
            runs[isa] = run_engine(Engine(path, ecfg, quiet=True), prompts)
    finally:
        monkeypatch.undo()
        native.refresh()
    (out0, l0), first = runs[have[0]], have[0]
    for isa in have[1:]:
        out, lo = runs[isa]
        assert out == out0, f"{isa} tokens differ from {first}"
        for i in out0:
            assert torch.equal(torch.stack(lo[i]), torch.stack(l0[i])), f"{isa} logits differ from {first}, prompt {i}"


def test_module_path_where_fusion_does_not_apply(family_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # dense float32 weights multiply on the row kernel as F32 blocks (loader/build.py), so they fuse too
    assert Engine(family_gguf, EngineConfig(dtype="float32"), quiet=True).runner.fused is not None
    assert Engine(family_gguf, EngineConfig(dtype="bfloat16"), quiet=True).runner.fused is None
    contiguous = Engine(family_gguf, EngineConfig(dtype="auto", kv_cache_layout="contiguous"), quiet=True)
    assert contiguous.runner.fused is None
    monkeypatch.setenv("KVLM_FUSED_DECODE", "0")
    assert Engine(family_gguf, EngineConfig(dtype="auto"), quiet=True).runner.fused is None

