"""Mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral) against Hugging Face transformers, from both formats,
and the routed MLP (model/moe.py) against its pure-PyTorch definition: the native one-call block
(csrc/moe.cpp, `moe_mlp`: router, native softmax and top-k, grouped experts) as the engine runs it, and
the PyTorch path (dense experts).

Each family is a tiny random model the test writes as a GGUF file (llama.cpp's names: the router
`ffn_gate_inp`, the experts stacked in 3-D `ffn_*_exps`, `expert_count` / `expert_used_count`, Mixtral as arch
"llama" with permuted Q/K) and as an HF safetensors folder (one tensor per expert; Mixtral's
`block_sparse_moe.experts.E.w1/w3/w2`), and the same weights in transformers (float32, eager attention):
`--dtype float32` logits within 1e-4 and identical greedy tokens on 6 prompts. The bit-exact engine
equivalences are in tests/engine/test_exact_moe.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from deps import need, need_native
from engine_runs import random_prompts, run_engine
from tiny_moe import hf_moe_model, moe_config, moe_state_dict, write_moe_gguf, write_moe_hf_dir

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import KvlmError
from kvlm.kernels import ExpertStack, QuantTensor
from kvlm.loader import load_checkpoint, load_config
from kvlm.model.moe import MoEMLP, moe_reference, route

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KINDS = ("qwen3_moe", "olmoe", "mixtral")
CONFIGS = {k: moe_config(k) for k in KINDS}
STATES = {k: moe_state_dict(CONFIGS[k]) for k in KINDS}


@pytest.fixture(scope="module", params=[f"{k}-{fmt}" for k in KINDS for fmt in ("gguf", "safetensors")])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    kind, fmt = request.param.split("-")
    root = tmp_path_factory.mktemp(kind)
    if fmt == "gguf":
        return kind, write_moe_gguf(root / "tiny.gguf", CONFIGS[kind], STATES[kind])
    return kind, write_moe_hf_dir(root / "hf", CONFIGS[kind], STATES[kind])


_HF: dict[str, Any] = {}


def test_config_from_both_formats(model: tuple[str, Path]) -> None:
    kind, path = model
    c = load_config(path)
    assert c.model_type == kind and c.architecture == CONFIGS[kind]["architectures"][0]
    want = {"qwen3_moe": (8, 2, 32, True, False), "olmoe": (8, 4, 32, False, True), "mixtral": (4, 2, 64, True, False)}
    got = (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob, c.qk_norm_full)
    assert got == want[kind]
    assert c.qk_norm == (kind != "mixtral")
    assert all(c.is_moe_layer(n) for n in range(c.num_hidden_layers))
    # Every routed layer: router E x h and E experts of 3 x h x I; a token computes with top-k of them
    h, E, k, inter = c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size
    assert c.num_parameters - c.num_active_parameters == c.num_hidden_layers * (E - k) * 3 * h * inter


def test_matches_transformers(model: tuple[str, Path]) -> None:
    """Greedy tokens and every step's logits on 6 prompts."""
    need("transformers")
    kind, path = model
    if kind not in _HF:
        _HF[kind] = hf_moe_model(CONFIGS[kind], STATES[kind])
    hf = _HF[kind]
    prompts = random_prompts(6, 43, lo=4, hi=40)
    tokens, logits = run_engine(Engine(path, EngineConfig(dtype="float32", max_model_len=64), quiet=True),
                                prompts, GREEDY)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                              pad_token_id=CONFIGS[kind]["vocab_size"] - 1)
        assert tokens[i] == out.sequences[0, len(ids):].tolist(), f"prompt {i}"
        for step, (ours, ref) in enumerate(zip(logits[i], out.logits)):
            assert (ours - ref[0]).abs().max().item() < 1e-4, f"prompt {i}, step {step}"


def test_quantized_experts_stay_stacked_views_of_the_file(tmp_path: Path) -> None:
    """The default GGUF path keeps each layer's experts as one (E, I, h) ExpertStack over the mapped file."""
    cfg, state = CONFIGS["qwen3_moe"], STATES["qwen3_moe"]
    path = write_moe_gguf(tmp_path / "q8.gguf", cfg, state, tensor_type="Q8_0")
    engine = Engine(path, EngineConfig(), quiet=True)
    experts = engine.model.model.layers[1].mlp.experts
    stack = experts.stacks["gate_proj"]
    assert isinstance(stack, ExpertStack) and stack.shape == (8, 32, 64) and stack.qtype.name == "Q8_0"
    assert not stack.data.is_contiguous() or stack.data.untyped_storage().nbytes() > stack.nbytes  # a view
    assert set(experts.stacks) == {"gate_proj", "up_proj", "down_proj"} and not list(experts.parameters())


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    target, rss, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
                inside = len(head) == 6 and head[5] == target
            elif inside and head[0] == "Rss:":
                rss += int(head[1]) * 1024
    return rss


def test_untouched_experts_cost_no_resident_memory(tmp_path: Path) -> None:
    """Experts stay memory-mapped: after loading, no expert page is resident; running one expert of 64 makes
    its own bytes resident and not the layer's (the kernel maps some neighbouring pages on each fault:
    fault-around, large page-cache folios; at most 2 MiB folios for each of the 3 projections)."""
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("needs /proc/self/smaps")
    cfg = moe_config("qwen3_moe", hidden_size=256, num_experts=64, moe_intermediate_size=512, num_hidden_layers=1)
    path = write_moe_gguf(tmp_path / "big.gguf", cfg, moe_state_dict(cfg), tensor_type="Q8_0")
    engine = Engine(path, EngineConfig(), quiet=True)
    experts = engine.model.model.layers[0].mlp.experts
    per_expert = experts.nbytes_per_expert  # 3 x 512 rows x 272 bytes = 408 KiB
    before = _mapped_rss(path)
    assert before < per_expert, before  # metadata, norms and attention only
    experts(3, torch.randn(2, 256))
    grew = _mapped_rss(path) - before
    assert 0.9 * per_expert <= grew <= 0.5 * 64 * per_expert, (grew, per_expert)


def test_route_breaks_ties_by_expert_id() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0], [0.0, 5.0, 1.0, 5.0]])
    ids, w = route(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1], [1, 3]]
    assert torch.equal(w, torch.full((3, 2), 0.5))
    ids, _ = route(logits, 3, renormalize=False)
    assert ids.tolist() == [[1, 2, 0], [0, 1, 2], [1, 3, 2]]


def _block(kind: str, qtype: str | None = None, zero_router: bool = False) -> tuple[MoEMLP, dict[str, Any]]:
    """Layer 0's routed MLP of the tiny model as the engine builds it: its router on F32 blocks, its experts in
    `qtype` blocks (F32: the dense float32 path's; None: dense parameters, multiplied with torch)."""
    from kvlm.config import ModelConfig
    from kvlm.kernels.ggml_types import GGMLQuantizationType
    from kvlm.loader import f32_blocks
    from kvlm.model.quant_layers import QuantLinear

    cfg, state = CONFIGS[kind], STATES[kind]
    mlp = MoEMLP(ModelConfig.from_hf_dict(cfg))
    p = "model.layers.0.mlp."
    router = torch.zeros_like(state[p + "gate.weight"]) if zero_router else state[p + "gate.weight"]
    mlp.gate.weight = torch.nn.Parameter(router, requires_grad=False)
    if qtype is not None:
        mlp.gate = QuantLinear(f32_blocks(router))
    E = mlp.experts.num_experts
    dense = {n: [state[f"{p}experts.{e}.{n}.weight"] for e in range(E)] for n in ("gate_proj", "up_proj", "down_proj")}
    for n, ws in dense.items():
        if qtype is None:
            mlp.experts.set(n, torch.stack(ws))
        elif qtype == "F32":
            mlp.experts.set(n, f32_blocks(torch.stack(ws)))
        else:
            import gguf

            t = gguf.GGMLQuantizationType[qtype]
            blocks = torch.from_numpy(gguf.quants.quantize(torch.stack(ws).numpy(), t))
            mlp.experts.set(n, ExpertStack(blocks, GGMLQuantizationType(int(t)), (E, *ws[0].shape)))
    return mlp, {"router": router, **dense}


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("kind", KINDS)
def test_grouped_experts_match_the_reference_and_are_row_invariant(kind: str, qtype: str | None) -> None:
    """The grouped path equals `moe_reference` (the kernels' matmul on the same blocks, one token at a time)
    to float32 rounding, and each token's row has the same bits alone as in any batch."""
    from kvlm.kernels import qmatmul

    mlp, w = _block(kind, qtype)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        out = mlp(x)
        stacks = mlp.experts.stacks

        def experts(n: str) -> list[Any]:
            return [stacks[n].expert(e) for e in range(len(w[n]))] if stacks else w[n]

        ref = moe_reference(x, w["router"], experts("gate_proj"), experts("up_proj"), experts("down_proj"),
                            mlp.top_k, mlp.renormalize,
                            matmul=lambda a, b: qmatmul(a, b) if isinstance(b, QuantTensor) else a @ b.T)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for rows in ([0], [4], [3, 7], list(range(10, -1, -1))):
            assert torch.equal(mlp(x[rows]), out[rows]), rows


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_sized_steps_have_the_bits_of_big_steps(threads: int) -> None:
    """A step of up to 32 (token, expert) pairs runs its experts in one parallel region (csrc/moe.cpp
    `experts_fused`: an expert's gate, up and down without a join, units of equal bytes, a wait where two
    units share an expert); a bigger one in two calls. Every row has the same bits either way, at 1, 2 and
    3 threads (3 units split experts between them)."""
    need_native()
    mlp, _ = _block("olmoe", "Q4_0")  # top 4 of 8, int8 activations
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(9))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            whole = mlp(x)  # 64 pairs: the two-call path
            for rows in ([0], [5, 9], [1, 2, 3], [15, 0, 7, 3, 11], list(range(8))):  # 4 .. 32 pairs
                assert torch.equal(mlp(x[rows]), whole[rows]), rows
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", ["F32", "Q4_0"])  # float32 and int8 activations
def test_big_steps_run_in_passes_with_the_same_bits_and_bounded_buffers(qtype: str) -> None:
    """A step whose `moe_mlp` work buffers would pass the budget (128 MiB; here lowered) runs in passes of
    whole tokens: every row has the bits of the step in one pass, the counters count the step once, and
    this thread's buffers hold at most the budget (they only grew to the largest step before)."""
    need_native()
    from kvlm.kernels import native

    ops = native.ops()
    mlp, _ = _block("olmoe", qtype)
    x = torch.randn(203, 64, generator=torch.Generator().manual_seed(7))
    try:
        with torch.inference_mode():
            ops.moe_buffers(0, True)
            whole, stats = mlp(x), mlp.stats.clone()
            one_pass = ops.moe_buffers(0, False)
            for budget in (one_pass // 3, one_pass // 50, 1):  # 3 passes, about 50, one token each
                ops.moe_buffers(budget, True)
                mlp.stats.zero_()
                assert torch.equal(mlp(x), whole), budget
                assert torch.equal(mlp.stats, stats), budget
                assert ops.moe_buffers(0, False) <= max(budget, one_pass // 203 * 2), budget
    finally:
        ops.moe_buffers(128 << 20, True)


def test_native_route_matches_route_and_breaks_ties_by_id() -> None:
    """The native routing (moe.cpp: its own softmax, a strict-greater top-k scan of the logits) picks `route`'s
    experts in `route`'s order, ties by expert id, and its weights agree to float32 rounding; logits spread so
    wide that probabilities underflow still rank by logit."""
    need_native()
    from kvlm.kernels import native

    ops = native.ops()

    def native_route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = torch.empty(logits.shape[0], k, dtype=torch.int64), torch.empty(logits.shape[0], k)
        ops.moe_route(logits.contiguous(), k, renormalize, ids, w)
        return ids, w

    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [3.0, 3.0, 3.0, 3.0], [0.0, 5.0, 1.0, 5.0]])
    ids, w = native_route(logits, 2, True)
    assert ids.tolist() == [[1, 2], [0, 1], [1, 3]] and torch.equal(w, torch.full((3, 2), 0.5))
    assert native_route(logits, 3, False)[0].tolist() == [[1, 2, 0], [0, 1, 2], [1, 3, 2]]
    x = torch.randn(64, 40, generator=torch.Generator().manual_seed(3)) * 3
    for k, renormalize in ((8, False), (2, True), (40, True)):
        ids, w = native_route(x, k, renormalize)
        want_ids, want_w = route(x, k, renormalize)
        assert torch.equal(ids, want_ids), k
        torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
    wide = x * 100  # e^(l - max) underflows for most experts: the choice still follows the logits
    ids, _ = native_route(wide, 8, False)
    assert torch.equal(ids, torch.sort(wide, dim=-1, descending=True, stable=True).indices[:, :8])


@pytest.mark.parametrize("qtype", [None, "Q8_0"])  # the PyTorch path; the native block
def test_router_tie_picks_the_lowest_expert_ids(qtype: str | None) -> None:
    """A router of zeros ties every expert: each token takes experts 0..k-1 with equal weights."""
    if qtype is not None:
        need_native()
    mlp, w = _block("olmoe", qtype, zero_router=True)
    assert (mlp.native_args() is not None) == (qtype is not None)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6))
    ids, weights = route(mlp.gate(x), mlp.top_k, mlp.renormalize)
    assert ids.tolist() == [[0, 1, 2, 3]] * 5 and torch.all(weights == 1 / 8)
    with torch.inference_mode():
        expect = sum(mlp.experts(e, x) * (1 / 8) for e in range(4))
        assert torch.allclose(mlp(x), expect, atol=1e-6)


def test_bad_moe_configs_are_one_line(tmp_path: Path) -> None:
    cfg = {**CONFIGS["qwen3_moe"], "num_experts_per_tok": 9}
    path = write_moe_hf_dir(tmp_path / "hf", cfg, STATES["qwen3_moe"])
    with pytest.raises(KvlmError) as e:
        load_checkpoint(path)
    assert "\n" not in str(e.value) and "num_experts_per_tok" in str(e.value)
    state = {k: v for k, v in STATES["mixtral"].items() if ".experts.2." not in k}
    path = write_moe_hf_dir(tmp_path / "mix", CONFIGS["mixtral"], state)
    with pytest.raises(KvlmError) as e:
        Engine(path, EngineConfig(), quiet=True)
    assert "\n" not in str(e.value) and "experts" in str(e.value), str(e.value)




@pytest.mark.parametrize("fmt", ["Q8_0", "safetensors"])
def test_info_shows_active_parameters_and_bytes_per_token(tmp_path: Path, fmt: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`kvlm info`: total and active parameters, and the weight bytes a token reads: all matrices but the
    embedding table's other rows, and k / E of each layer's experts."""
    import json

    from kvlm.cli.main import main

    kind = "olmoe"  # top 4 of 8
    cfg, state = CONFIGS[kind], STATES[kind]
    path = (write_moe_gguf(tmp_path / "m.gguf", cfg, state, tensor_type=fmt) if fmt != "safetensors"
            else write_moe_hf_dir(tmp_path / "hf", cfg, state))
    assert main(["-q", "info", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    L, h, E, k, inter, V = 2, 64, 8, 4, 32, cfg["vocab_size"]
    experts = L * E * 3 * h * inter
    assert doc["parameters"] == sum(t.numel() for t in state.values())
    assert doc["active_parameters"] == doc["parameters"] - experts * (E - k) // E
    assert "top 4 of 8" in doc["experts"]
    if fmt == "safetensors":  # float32, the embedding table bar one row
        assert doc["weight_bytes_per_token"] == 4 * (doc["active_parameters"] - V * h + h)
    else:  # Q8_0: 34 bytes per 32 weights in every matrix; norms and the router F32
        matrices = sum(t.numel() for n, t in state.items() if t.ndim == 2 and ".gate." not in n)
        dense = sum(t.numel() for n, t in state.items() if t.ndim == 1 or ".gate." in n)
        active_q8 = (matrices - experts * (E - k) // E - V * h + h)
        assert doc["weight_bytes_per_token"] == active_q8 * 34 // 32 + 4 * dense
