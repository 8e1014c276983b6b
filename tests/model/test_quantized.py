"""The quantized path (`--dtype auto`): GGUF weights kept in their block formats as views of the mapped
file, computed on by kvlm.kernels; against the float32 reference path (`--dtype float32`).

* loading: weights are QuantTensor views over the file (no dequantized copy), the Q/K un-permute and the
  q/k/v, gate/up stacks are byte-row operations whose dequantization equals the reference's weights;
* stacks of mixed formats and the embedding's row lookup against dense references;
* engine equivalences (cache == no cache, paged == contiguous, alone == batch, preempted == not) on a
  quantized tiny GGUF, token for token;
* the default model: greedy tokens of the quantized path agree with the float32 reference path for
  32 tokens on the README's and the tests' prompts, or part only at a near-tie (margin reported).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from deps import need_native
from engine_runs import random_prompts, run_engine
from gguf import GGMLQuantizationType, quants
from tiny_models import tiny_config, write_tiny_gguf

from kvlm import LLM, EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.kernels import QuantTensor, dequantize, kernel_path, native
from kvlm.kernels.reference import fake_quantize_act
from kvlm.loader.gguf import load_gguf
from kvlm.model.llama import stack_weights
from kvlm.model.quant_layers import QuantEmbedding, QuantLinear, stack_quant

Q = GGMLQuantizationType


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def quant_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config(tie_word_embeddings=False)
    return write_tiny_gguf(tmp_path_factory.mktemp("q") / f"tiny-{request.param}.gguf", cfg,
                           tensor_type=request.param)


def test_quantized_state_is_views_of_the_mapped_file(quant_gguf: Path) -> None:
    _, qstate, _ = load_gguf(quant_gguf, quantized=True)
    _, ref, _ = load_gguf(quant_gguf, quantized=False)
    size = quant_gguf.stat().st_size

    def in_file(x: QuantTensor) -> bool:  # a view of the whole-file mapping, not a copy of its bytes
        return x.data.untyped_storage().nbytes() == size
    for name, t in qstate.items():
        if isinstance(t, torch.Tensor):
            assert t.ndim == 1, name  # only norms (and biases) are dense
            continue
        assert isinstance(t, QuantTensor), name
        assert in_file(t) == (".q_proj." not in name and ".k_proj." not in name), name  # only Q/K rows are permuted
        assert torch.equal(dequantize(t), ref[name]), name  # un-permuted byte rows == un-permuted floats
    qs, rs = stack_weights(dict(qstate)), stack_weights(dict(ref))
    for name in [k for k in qs if "gate_up_proj" in k or "qkv_proj" in k]:
        parts = qs[name]
        # q and k are un-permuted copies, so q, k and v stay three parts (no fourth copy stacking them);
        # gate and up lie back to back in the file: one view, no copy
        assert len(parts) == (3 if "qkv_proj" in name else 1), name
        assert torch.equal(torch.cat([dequantize(p) for p in parts]), rs[name]), name
        if "gate_up_proj" in name:
            assert in_file(parts[0])


def _quant(w: torch.Tensor, qtype: GGMLQuantizationType) -> QuantTensor:
    raw = w.numpy() if qtype == Q.F32 else quants.quantize(w.numpy(), qtype)
    if qtype == Q.F32:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    return QuantTensor(torch.from_numpy(np.ascontiguousarray(raw)), qtype, tuple(w.shape))


def test_mixed_format_stack_and_embedding_rows() -> None:
    """q in Q4_0, k in Q4_0, v in Q8_0 (as Q4_K_M files mix formats): q and k back to back in one storage
    merge as a view, v stays apart; apart in memory, q and k stay two parts (no copy). Each layer equals the
    dense product of the dequantized parts, and the two layers the same bits. The embedding dequantizes
    only its rows."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, 64, generator=g) for n in (64, 32, 32)]
    parts = [_quant(ws[0], Q.Q4_0), _quant(ws[1], Q.Q4_0), _quant(ws[2], Q.Q8_0)]
    apart = stack_quant(parts)
    assert [p.qtype for p in apart] == [Q.Q4_0, Q.Q4_0, Q.Q8_0]
    assert all(s.data.data_ptr() == p.data.data_ptr() for s, p in zip(apart, parts))
    qk = torch.cat([parts[0].data, parts[1].data])  # q and k back to back, as in a file that lists them so
    views = [QuantTensor(qk[:64], Q.Q4_0, (64, 64)), QuantTensor(qk[64:], Q.Q4_0, (32, 64)), parts[2]]
    stacked = stack_quant(views)
    assert [p.qtype for p in stacked] == [Q.Q4_0, Q.Q8_0] and stacked[0].shape == (96, 64)
    assert stacked[0].data.data_ptr() == qk.data_ptr()
    bias = torch.randn(128, generator=g)
    layer = QuantLinear(stacked, bias)
    x = torch.randn(5, 64, generator=g)
    dense = torch.cat([dequantize(p) for p in parts])
    int8 = all(kernel_path(p.qtype).endswith("+int8") for p in parts)  # the default on AVX2 / AVX-512
    xr = fake_quantize_act(x) if int8 else x  # what the kernels multiply with
    torch.testing.assert_close(layer(x), xr @ dense.T + bias, rtol=1e-5, atol=1e-4)
    assert torch.equal(QuantLinear(apart, bias)(x), layer(x))
    emb_w = _quant(torch.randn(50, 64, generator=g), Q.Q8_0)
    emb = QuantEmbedding(emb_w)
    ids = torch.tensor([3, 49, 3, 0])
    assert torch.equal(emb(ids), dequantize(emb_w)[ids])


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16])
def test_unquantized_parts_are_never_copied_into_a_stack(qtype: GGMLQuantizationType) -> None:
    """F32 / F16 / BF16 parts stack only where they are back to back in one storage (a view); apart, they
    stay separate parts rather than a copy (a bf16 1B model's q/k/v and gate/up would be 1.3 GB more), and
    the layer's outputs are those of the parts multiplied one by one, bit for bit."""
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, 64, generator=g) for n in (48, 16, 16)]
    dt = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]

    def raw(w: torch.Tensor) -> torch.Tensor:
        return w.to(dt).contiguous().view(torch.uint8).reshape(w.shape[0], -1)
    parts = [QuantTensor(raw(w), qtype, tuple(w.shape)) for w in ws]
    stacked = stack_quant(parts)
    assert len(stacked) == 3 and all(s.data.data_ptr() == p.data.data_ptr() for s, p in zip(stacked, parts))
    whole = torch.cat([raw(w) for w in ws])  # one storage, rows back to back: views of it, merged as a view
    rb = whole.shape[1]
    views = [QuantTensor(whole[a:b], qtype, (b - a, 64)) for a, b in ((0, 48), (48, 64), (64, 80))]
    merged = stack_quant(views)
    assert len(merged) == 1 and merged[0].data.data_ptr() == whole.data_ptr() and merged[0].shape == (80, 64)
    assert merged[0].data.shape == (80, rb)
    x = torch.randn(3, 64, generator=g)
    apart = QuantLinear(stacked)(x)
    assert torch.equal(apart, torch.cat([QuantLinear(p)(x) for p in parts], dim=-1))
    assert torch.equal(apart, QuantLinear(merged)(x))


def test_engine_equivalences_on_the_quantized_path(quant_gguf: Path) -> None:
    """cache == no cache, paged == contiguous, alone == in a batch, preempted == not: token for token."""
    if "Q8_0" in quant_gguf.name:
        pytest.skip("one block format is enough here (kernels are tested per format in their own tests)")
    prompts = random_prompts(4, 3)
    auto = EngineConfig(dtype="auto", block_size=4)
    ref, _ = run_engine(Engine(quant_gguf, auto, quiet=True), prompts)
    assert isinstance(Engine(quant_gguf, auto, quiet=True).model.lm_head, QuantLinear)
    nocache, _ = run_engine(Engine(quant_gguf, EngineConfig(dtype="auto", enable_kv_cache=False), quiet=True), prompts)
    contiguous, _ = run_engine(Engine(quant_gguf, EngineConfig(dtype="auto", kv_cache_layout="contiguous"),
                                      quiet=True), prompts)
    chunked = EngineConfig(dtype="auto", block_size=4, max_num_batched_tokens=16)
    alone = {i: run_engine(Engine(quant_gguf, chunked, quiet=True), [p])[0][0] for i, p in enumerate(prompts)}
    assert nocache == ref and contiguous == ref and alone == ref

    long_prompts = random_prompts(6, 7, lo=10, hi=30)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    free_run, _ = run_engine(Engine(quant_gguf, auto, quiet=True), long_prompts, params)
    per_token = Engine(quant_gguf, auto, quiet=True).kv_bytes_per_token
    small = Engine(quant_gguf, EngineConfig(dtype="auto", block_size=4, kv_cache_memory=24 * 4 * per_token),
                   quiet=True)
    reqs = [small.add_request(p, params) for p in long_prompts]
    while small.has_unfinished:
        small.step()
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert {i: r.output_token_ids for i, r in enumerate(reqs)} == free_run


def test_in_place_attention_equals_gather_path(tiny_gguf: Path) -> None:
    """Every row attending in place over the paged blocks (attention.paged) gives the tokens of the
    reference gather + SDPA, logits within float32 rounding, on a batch of very different lengths."""
    prompts = random_prompts(7, 5, lo=2, hi=90)
    cfg = EngineConfig(block_size=8, max_num_batched_tokens=64)
    gather = Engine(tiny_gguf, cfg, quiet=True)
    gather.runner.in_place = False
    ref, lref = run_engine(gather, prompts)
    need_native("in-place attention is the native kernel")
    inplace = Engine(tiny_gguf, cfg, quiet=True)
    assert inplace.runner.in_place
    out, lout = run_engine(inplace, prompts)
    assert out == ref
    for i in ref:
        torch.testing.assert_close(torch.stack(lout[i]), torch.stack(lref[i]), atol=1e-4, rtol=0)


@pytest.fixture
def f32_activations(monkeypatch: pytest.MonkeyPatch):
    """KVLM_KERNEL_ACT=f32 for one test: quantized weights, float32 activations."""
    monkeypatch.setenv(native.ENV_ACT, "f32")
    native.refresh()
    yield
    monkeypatch.undo()
    native.refresh()


def test_quantized_path_matches_float32_path_on_tiny(quant_gguf: Path, f32_activations: None) -> None:
    """Same weights as the float32 path (the dequantized blocks) and float32 activations: greedy tokens agree."""
    prompts = random_prompts(3, 5)
    q, _ = run_engine(Engine(quant_gguf, EngineConfig(dtype="auto"), quiet=True), prompts)
    f, _ = run_engine(Engine(quant_gguf, EngineConfig(dtype="float32"), quiet=True), prompts)
    assert q == f


def test_int8_activations_part_from_float32_only_at_near_ties(quant_gguf: Path) -> None:
    """The default (int8 activations where the kernels have them) against the float32 path on the tiny
    model: logits within 2% of their range; greedy tokens agree, or part only at a step where the
    reference's top-2 margin is below twice the largest logit deviation seen before it."""
    prompts = random_prompts(3, 5)
    q, lq = run_engine(Engine(quant_gguf, EngineConfig(dtype="auto"), quiet=True), prompts)
    f, lf = run_engine(Engine(quant_gguf, EngineConfig(dtype="float32"), quiet=True), prompts)
    for i in f:
        k = next((j for j, (a, b) in enumerate(zip(q[i], f[i])) if a != b), len(f[i]))
        dev = max(float((a - b).abs().max()) for a, b in zip(lq[i][:k + 1], lf[i][:k + 1]))
        assert dev <= 0.02 * float(lf[i][0].max() - lf[i][0].min()), f"prompt {i}: logits deviation {dev:.4g}"
        if k < len(f[i]):
            top = lf[i][k].topk(2).values
            assert float(top[0] - top[1]) < 2 * dev, f"prompt {i} parts at token {k} without a near-tie"


# README's and the tests' prompts (tests/model/test_exactness.py), plus a chat turn.
README_PROMPTS = ["The capital of France is", "Hello", "What is a KV cache?", "Write a haiku about caches"]
EXACTNESS_PROMPTS = ["def quicksort(arr):\n    if len(arr) <= 1:\n", "日本の首都は東京です。The weather today is",
                     "Once upon a time, in a land far away, there lived a dragon who loved 🐉 and"]


# Where greedy paths part, the reference's top-2 margin at that step must be below this ("a near-tie"):
# quantized weights with float32 activations differ from the reference by float32 rounding only; int8
# activations (the default for Q4_0 / Q4_1 / Q8_0) move the default model's logits by up to 1.74 (6% of
# their range; teacher-forced at each of the reference's 32 greedy tokens on these prompts, 256 positions,
# mean 0.74; 2026-12-05, the same bits on the AVX2 and AVX-512 paths), so ties within 0.5 can flip.
# `PYTHONPATH=. python scripts/int8_logits_deviation.py --every-step` measures it (without the flag, at
# 5 of the steps: 0.92 today, 1.14 on 2026-12-01, which this bound was once set from).
NEAR_TIE = {"f32": 0.05, "int8": 0.5}
INT8_MAX_LOGIT_DEVIATION = 2.0  # the measured 1.74 and a margin


@pytest.mark.slow
@pytest.mark.parametrize("act", ["int8"])  # the default; "f32" (NEAR_TIE 0.05) passes too, but costs a minute
def test_default_model_quantized_agrees_with_float32_reference(smollm2_gguf: Path, smollm2_llm: LLM, act: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """32 greedy tokens per prompt; where the paths part, the reference's top-2 margin at that step must
    be a near-tie (NEAR_TIE[act]), which is reported, and the logits there within the stated deviation."""
    monkeypatch.setenv(native.ENV_ACT, act)
    native.refresh()
    try:
        quant = LLM(str(smollm2_gguf), num_threads=2, dtype="auto")
        assert isinstance(quant.llm_engine.model.model.layers[0].mlp.down_proj, QuantLinear)
        ref_eng, q_eng = smollm2_llm.llm_engine, quant.llm_engine
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        inputs = [quant.tokenizer.encode(p) for p in README_PROMPTS + EXACTNESS_PROMPTS]
        inputs += [quant.render_chat([{"role": "user", "content": "What is a KV cache?"}])]
        # One batched call per path (the engine equivalences make a batch equal each prompt alone).
        batch = [{"prompt_token_ids": ids} for ids in inputs]
        outs_q = [o.outputs[0].token_ids for o in quant.generate(batch, params, use_tqdm=False)]
        outs_r = [o.outputs[0].token_ids for o in smollm2_llm.generate(batch, params, use_tqdm=False)]

        def last_logits(eng: Engine, ids: list[int]) -> torch.Tensor:
            r = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
            eng.step(keep_logits=True)
            assert r.is_finished
            return eng.last_result.logits[0]

        for ids, a, b in zip(inputs, outs_q, outs_r):
            if a == b:
                continue
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            lr, lq = last_logits(ref_eng, ids + b[:k]), last_logits(q_eng, ids + b[:k])
            top = lr.topk(2).values
            margin, dev = float(top[0] - top[1]), float((lq - lr).abs().max())
            print(f"{act}: paths part at token {k} of {quant.tokenizer.decode(ids)[:30]!r}: reference margin "
                  f"{margin:.4f}, max |logit deviation| there {dev:.3f}")
            assert margin < NEAR_TIE[act], \
                f"parted at token {k} with a reference margin of {margin:.3f} (not a near-tie)"
            if act == "int8":
                assert dev < INT8_MAX_LOGIT_DEVIATION
    finally:
        monkeypatch.undo()
        native.refresh()
