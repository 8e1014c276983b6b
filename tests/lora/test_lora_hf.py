"""LoRA adapters against Hugging Face PEFT (`PeftModel`, float32): an adapter the test makes with `peft` on a
tiny random Llama, loaded by kvlm from its PEFT folder and from the GGUF LoRA file llama.cpp's converter
would write, on a safetensors base and a GGUF base (permuted Q/K rows), logits within 1e-4 on
`--dtype float32` and on the native F32 rows (`--dtype auto`); greedy tokens identical. Then the same on
the real default model (SmolLM2-135M, its GGUF loaded by transformers). Bad adapters fail with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from deps import need
from engine_runs import random_prompts
from tiny_models import random_state_dict, tiny_config, write_tiny_gguf, write_tiny_hf_dir

from kvlm import LLM, EngineConfig, LoRARequest, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.errors import LoRAError, UnknownLoRAError

CFG = tiny_config()
STATE = random_state_dict(CFG)
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {"all": (ATTN_MLP, 4, 8.0, False), "qv-rslora": (["q_proj", "v_proj"], 8, 16.0, True)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-base")
    return {"gguf": write_tiny_gguf(root / "tiny.gguf", CFG, STATE),
            "safetensors": write_tiny_hf_dir(root / "hf", CFG, STATE)}


@pytest.fixture(scope="module", params=list(CASES))
def adapter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """(PeftModel, PEFT folder, GGUF LoRA file) of one random adapter."""
    need("peft")
    from tiny_lora import peft_model, save_peft, write_gguf_lora

    targets, r, alpha, rslora = CASES[request.param]
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    pm = peft_model(CFG, STATE, targets, r=r, alpha=alpha, seed=1, rslora=rslora)
    folder = save_peft(pm, root / "peft")
    gguf_alpha = alpha * (r ** 0.5) if rslora else alpha  # llama.cpp's scale is alpha / r: the same product
    return pm, folder, write_gguf_lora(root / "adapter.gguf", pm, CFG, gguf_alpha)


def _peft_greedy(pm: Any, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    toks, logits = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            row = pm(torch.tensor([toks])).logits[0, -1]
            logits.append(row)
            toks.append(int(row.argmax()))
    return toks[len(ids):], logits


def _greedy(eng: Engine, ids: list[int], n: int, lora: str) -> tuple[list[int], list[torch.Tensor]]:
    """kvlm's greedy tokens and each step's logits for `ids` under adapter `lora`."""
    req = eng.add_request(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), lora=lora)
    got = []
    while not req.is_finished:
        eng.step(keep_logits=True)
        got.append(eng.last_result.logits[0])
    return req.output_token_ids, got


@pytest.mark.parametrize("fmt", ["peft", "gguf"])
@pytest.mark.parametrize("base", ["gguf", "safetensors"])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_logits_match_peft(bases: dict[str, Path], adapter: tuple[Any, Path, Path], fmt: str, base: str,
                           dtype: str) -> None:
    pm, folder, gguf_file = adapter
    eng = Engine(bases[base], EngineConfig(dtype=dtype), quiet=True)
    eng.load_lora("a", folder if fmt == "peft" else gguf_file)
    for ids in random_prompts(2, seed=3, lo=5, hi=20):
        want_tokens, want = _peft_greedy(pm, ids, 6)
        tokens, got = _greedy(eng, ids, 6, "a")
        assert tokens == want_tokens
        for ours, ref in zip(got, want):
            assert (ours - ref).abs().max().item() < 1e-4
    # and the base is untouched: the same prompt without an adapter is PEFT's with the adapter disabled
    ids = random_prompts(1, seed=4, lo=5, hi=20)[0]
    with torch.no_grad(), pm.disable_adapter():
        ref = pm(torch.tensor([ids])).logits[0, -1]
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
    eng.step(keep_logits=True)
    assert (eng.last_result.logits[0] - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_rank_and_alpha_patterns_match_peft(bases: dict[str, Path], tmp_path: Path, dtype: str) -> None:
    """PEFT's per-module `rank_pattern` / `alpha_pattern` (keys matching a module path's end): the ranks come
    from the tensors, each module's scale from its own alpha over its own rank, as PEFT computes them."""
    need("peft")
    from tiny_lora import peft_model, save_peft

    ranks, alphas = {"v_proj": 2, "layers.1.mlp.down_proj": 6}, {"q_proj": 3.0, "model.layers.0.mlp.gate_proj": 20.0}
    pm = peft_model(CFG, STATE, ATTN_MLP, r=4, alpha=8.0, seed=7, rank_pattern=ranks, alpha_pattern=alphas)
    folder = save_peft(pm, tmp_path / "patterns")
    saved = json.loads((folder / "adapter_config.json").read_text())
    assert saved["rank_pattern"] == ranks and saved["alpha_pattern"] == alphas
    eng = Engine(bases["gguf"], EngineConfig(dtype=dtype), quiet=True)
    eng.load_lora("p", folder)
    ids = random_prompts(1, seed=8, lo=5, hi=20)[0]
    want_tokens, want = _peft_greedy(pm, ids, 5)
    tokens, got = _greedy(eng, ids, 5, "p")
    assert tokens == want_tokens
    assert max((ours - ref).abs().max().item() for ours, ref in zip(got, want)) < 1e-4
    # and the patterns matter: the same weights read with the default rank and alpha give other logits
    saved.pop("alpha_pattern")
    (folder / "adapter_config.json").write_text(json.dumps(saved))
    eng.load_lora("flat", folder)
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1), lora="flat")
    eng.step(keep_logits=True)
    assert (eng.last_result.logits[0] - want[0]).abs().max().item() > 1e-3


PHI3 = tiny_config("phi3", tie_word_embeddings=False)
PHI3_STATE = random_state_dict(PHI3, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_phi3_fused_projections_match_peft(tmp_path: Path, dtype: str) -> None:
    """PEFT adapters for Phi-3 target its fused `qkv_proj` and `gate_up_proj` (one A, one B over the parts'
    rows): kvlm splits B by the parts, from the PEFT folder and the GGUF LoRA file, on a GGUF and a safetensors
    base; logits within 1e-4 of PeftModel's, greedy tokens identical. Targeting a fused projection and one of
    its parts at once is one line."""
    need("peft")
    from safetensors.torch import load_file
    from tiny_lora import peft_model, save_peft, write_gguf_lora

    pm = peft_model(PHI3, PHI3_STATE, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], r=4, alpha=8.0, seed=2)
    folder = save_peft(pm, tmp_path / "peft")
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert any(".self_attn.qkv_proj.lora_B" in k for k in tensors) and any(".mlp.gate_up_proj." in k for k in tensors)
    adapters = {"peft": folder, "gguf": write_gguf_lora(tmp_path / "phi3-lora.gguf", pm, PHI3, 8.0)}
    bases = {"gguf": write_tiny_gguf(tmp_path / "phi3.gguf", PHI3, PHI3_STATE),
             "safetensors": write_tiny_hf_dir(tmp_path / "phi3-hf", PHI3, PHI3_STATE)}
    ids = random_prompts(1, seed=6, lo=5, hi=20)[0]
    want_tokens, want = _peft_greedy(pm, ids, 5)
    for base, base_path in bases.items():
        # context 64 = Phi-3's original one: LongRoPE's short factors, as transformers takes them for these prompts
        eng = Engine(base_path, EngineConfig(dtype=dtype, max_model_len=64), quiet=True)
        for fmt, path in adapters.items():
            a = eng.load_lora(fmt, path)
            assert set(a.targets) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
            tokens, got = _greedy(eng, ids, 5, fmt)
            assert tokens == want_tokens, (base, fmt)
            assert max((ours - ref).abs().max().item() for ours, ref in zip(got, want)) < 1e-4, (base, fmt)
    pre = "base_model.model.model.layers.0.self_attn"
    shapes = {"qkv_proj": (torch.randn(4, 64), torch.randn(128, 4)), "q_proj": (torch.randn(4, 64), torch.randn(64, 4))}
    both = {f"{pre}.{m}.lora_{ab}.weight": t for m, (a, b) in shapes.items() for ab, t in (("A", a), ("B", b))}
    with pytest.raises(LoRAError, match="targets both the fused qkv_proj and its part q_proj"):
        eng.load_lora("both", _write_peft(tmp_path / "both", both))


def test_llm_generate_takes_a_name_or_vllms_lora_request(bases: dict[str, Path],
                                                         adapter: tuple[Any, Path, Path]) -> None:
    pm, folder, _ = adapter
    llm = LLM(str(bases["gguf"]), dtype="float32")
    ids = random_prompts(1, seed=5, lo=5, hi=20)[0]
    want, _ = _peft_greedy(pm, ids, 5)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    via_request = llm.generate({"prompt_token_ids": ids}, sp, lora=LoRARequest("mine", 1, str(folder)))
    by_name = llm.generate([{"prompt_token_ids": ids}] * 2, sp, lora=["mine", None])
    assert via_request[0].outputs[0].token_ids == by_name[0].outputs[0].token_ids == want
    assert by_name[1].outputs[0].token_ids != want  # the base model's continuation


def _write_peft(folder: Path, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_bad_adapters_get_one_line(bases: dict[str, Path], tmp_path: Path) -> None:
    eng = Engine(bases["gguf"], EngineConfig(dtype="float32"), quiet=True)
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    good = {f"{pre}.lora_A.weight": torch.randn(4, 64), f"{pre}.lora_B.weight": torch.randn(64, 4)}
    cases = {
        "missing": (tmp_path / "nowhere", "no such file or folder"),
        "no-safetensors": (tmp_path / "empty", "has no adapter_config.json"),
        "shape": (_write_peft(tmp_path / "shape", {f"{pre}.lora_A.weight": torch.randn(4, 32),
                                                  f"{pre}.lora_B.weight": torch.randn(64, 4)}),
                  "lora_B @ lora_A is 64 x 32, the base module is 64 x 64"),
        "rank": (_write_peft(tmp_path / "rank", {f"{pre}.lora_A.weight": torch.randn(4, 64),
                                                f"{pre}.lora_B.weight": torch.randn(64, 3)}),
                 "do not share a rank"),
        "target": (_write_peft(tmp_path / "target", {
            "base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(4, 264)}), "is not a LoRA weight"),
        "layer": (_write_peft(tmp_path / "layer", {k.replace("layers.0", "layers.7"): v for k, v in good.items()}),
                  "the base model has 2 layers"),
        "dora": (_write_peft(tmp_path / "dora", good, use_dora=True), "DoRA"),
        "not-lora": (tmp_path / "t.txt", "neither a PEFT folder"),
    }
    (tmp_path / "empty").mkdir()
    (tmp_path / "t.txt").write_text("hello")
    for name, (path, msg) in cases.items():
        with pytest.raises(LoRAError) as e:
            eng.load_lora(name, path)
        assert msg in str(e.value) and "\n" not in str(e.value), (name, str(e.value))
    eng.load_lora("ok", _write_peft(tmp_path / "ok", good))
    with pytest.raises(LoRAError, match="already loaded"):
        eng.load_lora("ok", tmp_path / "ok")
    with pytest.raises(UnknownLoRAError, match="no LoRA adapter named 'nope'"):
        eng.add_request([1, 2, 3], lora="nope")
    eng.unload_lora("ok")
    with pytest.raises(UnknownLoRAError):
        eng.add_request([1, 2, 3], lora="ok")
    assert not eng.requests and not eng.has_unfinished  # nothing queued by a refused request


@pytest.mark.slow
def test_default_model_matches_peft(smollm2_gguf: Path, tmp_path: Path) -> None:
    """SmolLM2-135M (transformers loads its GGUF) with a random PEFT adapter on every projection."""
    transformers = need("transformers")
    need("peft")
    from peft import LoraConfig, get_peft_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                           dtype=torch.float32).eval()
    torch.manual_seed(0)
    pm = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=ATTN_MLP, init_lora_weights=False)).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)  # a fine-tune-sized change, not noise that swamps the base
    pm.save_pretrained(str(tmp_path / "ad"))
    llm = LLM(str(smollm2_gguf), dtype="float32", num_threads=2)
    llm.load_lora("smol", tmp_path / "ad")
    ids = llm.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        ref = pm(torch.tensor([ids])).logits[0, -1]
        with pm.disable_adapter():
            base = pm(torch.tensor([ids])).logits[0, -1]
    eng = llm.llm_engine
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=1), lora="smol")
    eng.step(keep_logits=True)
    ours = eng.last_result.logits[0]
    assert (ref - base).abs().max().item() > 1e-2  # the adapter matters
    assert (ours - ref).abs().max().item() < 1e-4
