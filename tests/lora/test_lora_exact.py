"""A row's bits do not depend on its neighbours' adapters: a batch mixing three adapters and none equals each
request alone (`torch.equal` on every step's logits, same tokens), with and without the KV cache, chunked or
whole, on a quantized base whose decode-only steps otherwise run the fused native step. Requests under
different adapters never share prefix-cache blocks; under the same adapter they do."""

from __future__ import annotations

from pathlib import Path

import pytest
from deps import need, need_native
from engine_runs import assert_identical, random_prompts, run_engine
from tiny_models import random_state_dict, tiny_config, write_tiny_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine

CFG = tiny_config()
STATE = random_state_dict(CFG)
ADAPTERS = {"a": (["q_proj", "v_proj"], 4), "b": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                   "down_proj"], 8), "c": (["down_proj", "gate_proj"], 2)}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    need("peft")
    from tiny_lora import peft_model, save_peft, write_gguf_lora

    root = tmp_path_factory.mktemp("lora-exact")
    base = write_tiny_gguf(root / "tiny-q8.gguf", CFG, STATE, tensor_type="Q8_0")
    out = {}
    for i, (name, (targets, r)) in enumerate(ADAPTERS.items()):
        pm = peft_model(CFG, STATE, targets, r=r, alpha=2.0 * r, seed=10 + i)
        out[name] = (write_gguf_lora(root / f"{name}.gguf", pm, CFG, 2.0 * r) if name == "c"
                     else save_peft(pm, root / name))
    return base, out


def _engine(files: tuple[Path, dict[str, Path]], **cfg: object) -> Engine:
    base, adapters = files
    eng = Engine(base, EngineConfig(**cfg), quiet=True)  # type: ignore[arg-type]
    for name, path in adapters.items():
        eng.load_lora(name, path, scale=0.5 if name == "b" else 1.0)
    return eng


@pytest.mark.parametrize("cfg", [{}, {"enable_kv_cache": False}, {"max_num_batched_tokens": 7},
                                 {"enable_prefix_caching": False, "kv_cache_layout": "contiguous"}],
                         ids=["cached", "no-cache", "chunked-7", "contiguous"])
def test_mixed_adapters_in_one_batch_equal_each_alone(files: tuple[Path, dict[str, Path]], cfg: dict) -> None:
    need_native()
    prompts = random_prompts(8, seed=21)
    loras = [None, "a", "b", "c", None, "c", "a", "b"]
    eng = _engine(files, **cfg)
    batch = run_engine(eng, prompts, GREEDY, loras=loras)
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        alone = run_engine(_engine(files), [p], GREEDY, loras=[lora])
        assert_identical(({0: batch[0][i]}, {0: batch[1][i]}), alone, f"prompt {i} under {lora}")
    # each adapter changes the logits: prompt 0's first logits differ under every one and the base
    first = [run_engine(eng, [prompts[0]], GREEDY, loras=[lora])[1][0][0] for lora in [None, "a", "b", "c"]]
    assert all((x - y).abs().max() > 1e-3 for i, x in enumerate(first) for y in first[i + 1:])


def test_fused_decode_applies_adapters_as_the_module_path(files: tuple[Path, dict[str, Path]]) -> None:
    """Decode-only steps with adapter rows run the fused native step; the module path gives the same bits."""
    need_native()
    prompts = random_prompts(6, seed=5)
    loras = ["a", None, "b", "c", "b", None]
    fused = _engine(files)
    assert fused.runner.fused is not None, fused.backend.describe()
    modules = _engine(files)
    modules.runner.fused = None
    assert_identical(run_engine(fused, prompts, GREEDY, loras=loras),
                     run_engine(modules, prompts, GREEDY, loras=loras), "fused vs module path")
    # an unloaded adapter's native plan is freed; loaded again (a new id), it is rebuilt and gives the same bits
    fused.unload_lora("b")
    fused.load_lora("b", files[1]["b"], scale=0.5)
    assert_identical(run_engine(fused, prompts[2:3], GREEDY, loras=["b"]),
                     run_engine(modules, prompts[2:3], GREEDY, loras=["b"]), "reloaded adapter")


def test_fused_decode_with_adapters_same_bits_on_1_and_2_threads(files: tuple[Path, dict[str, Path]]) -> None:
    """An adapted projection is one parallel region (base panels, A rows, B columns split across the threads):
    the split moves no bit."""
    import torch

    need_native()
    prompts = random_prompts(4, seed=8)
    loras = ["b", "a", None, "c"]
    before = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            eng = _engine(files, num_threads=n, adaptive_threads=False)
            assert eng.runner.fused is not None and torch.get_num_threads() == n
            runs.append(run_engine(eng, prompts, GREEDY, loras=loras))
    finally:
        torch.set_num_threads(before)
    assert_identical(runs[0], runs[1], "1 vs 2 threads")


def test_prefix_cache_never_shares_blocks_between_adapters(files: tuple[Path, dict[str, Path]]) -> None:
    eng = _engine(files, block_size=16)
    prompt = random_prompts(1, seed=9, lo=70, hi=70)[0]
    one = SamplingParams(temperature=0, max_tokens=1)
    reqs = []
    for lora in [None, "a", "b", "a", None, "c", "b"]:
        reqs.append([])
        run_engine(eng, [prompt], one, requests=reqs[-1], loras=[lora])
    cached = [r[0].metrics.num_cached_tokens for r in reqs]
    assert cached == [0, 0, 0, 64, 64, 0, 64]  # only a repeat under the same adapter (or none) hits


def test_switching_adapters_never_reloads_the_base(files: tuple[Path, dict[str, Path]]) -> None:
    eng = _engine(files)
    weights = [p.data.data_ptr() for m in eng.model.modules() for p in getattr(m, "parts", [])]
    eng.unload_lora("a")
    eng.load_lora("a", files[1]["a"])
    run_engine(eng, random_prompts(3, seed=2), GREEDY, loras=["a", "b", None])
    assert weights == [p.data.data_ptr() for m in eng.model.modules() for p in getattr(m, "parts", [])]


def test_snapshots_record_the_adapter(files: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    """A snapshot saved under an adapter records its name and key; it loads only where the same adapter (same
    weights and scale, any name) is loaded, and its blocks then serve that adapter's requests, bit for bit as
    computed; a missing or different adapter is one line and changes nothing. Base snapshots are as before."""
    import json

    from safetensors import safe_open

    from kvlm.errors import SnapshotError

    prompt = random_prompts(1, seed=13, lo=70, hi=70)[0]
    one = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    src = _engine(files, block_size=16)
    src.save_prefix(prompt, tmp_path / "b.kv", lora="b")
    src.save_prefix(prompt, tmp_path / "base.kv")
    with safe_open(str(tmp_path / "b.kv"), framework="pt") as f:
        assert json.loads(f.metadata()["lora"]) == {"name": "b", "key": src.loras.get("b").key}
    with safe_open(str(tmp_path / "base.kv"), framework="pt") as f:
        assert f.metadata()["lora"] == "none"
    expected = run_engine(_engine(files, block_size=16), [prompt], one, loras=["b"])

    base, adapters = files
    bare = Engine(base, EngineConfig(block_size=16), quiet=True)
    with pytest.raises(SnapshotError, match=r"saved under LoRA adapter 'b' \(.*\), which is not loaded$"):
        bare.load_prefix(tmp_path / "b.kv")
    bare.load_lora("b", adapters["b"], scale=1.0)  # the same file at another scale is another adapter
    with pytest.raises(SnapshotError, match="the adapter loaded as 'b' here differs"):
        bare.load_prefix(tmp_path / "b.kv")
    bare.unload_lora("b")
    bare.load_lora("renamed", adapters["b"], scale=0.5)
    info = bare.load_prefix(tmp_path / "b.kv")
    assert info.blocks_loaded == 4
    reqs: list = []
    got = run_engine(bare, [prompt], one, requests=reqs, loras=["renamed"])
    assert reqs[0].metrics.num_cached_tokens == 64  # the snapshot's blocks serve the adapter's request
    assert_identical(got, expected, "snapshot under an adapter")
    reqs = []
    run_engine(bare, [prompt], one, requests=reqs)  # ...and never the base's
    assert reqs[0].metrics.num_cached_tokens == 0
    assert bare.load_prefix(tmp_path / "base.kv").num_tokens == 64  # base snapshots as before


def test_cli_cache_save_under_an_adapter(files: tuple[Path, dict[str, Path]], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`kvlm cache save --lora NAME=PATH[:SCALE]` writes the snapshot `save_prefix(..., lora=NAME)` writes: it
    records the adapter and loads only where that adapter is loaded; two --lora are one line."""
    import json

    from safetensors import safe_open

    from kvlm.cli.main import main

    base, adapters = files
    path = tmp_path / "b.kv"
    text = "a prefix long enough for a few blocks under the adapter"
    assert main(["-q", "cache", "save", str(base), text, str(path), "--block-size", "4",
                 "--lora", f"b={adapters['b']}:0.5"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["lora"] == "b" and doc["blocks"] > 0
    eng = _engine(files, block_size=4)
    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["lora"]) == {"name": "b", "key": eng.loras.get("b").key}
    assert eng.load_prefix(path).num_blocks == doc["blocks"]
    assert main(["-q", "cache", "save", str(base), text, str(path), "--lora", f"a={adapters['a']}",
                 "--lora", f"b={adapters['b']}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvlm: error: --lora: a snapshot holds one adapter's K/V: give --lora once"]


def test_bfloat16_adapter_is_kept_compact_with_the_float32_bits(files: tuple[Path, dict[str, Path]], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter whose values bfloat16 holds exactly (saved in bfloat16; scale alpha / r = 2) keeps B^T in
    bfloat16 (A stays float32: BF16 rows would run with bf16 activations) and gives the bits the same values
    give as float32: fused step == module path == float32 weights, in a batch with other adapters == alone."""
    import torch
    from tiny_lora import ALL_TARGETS, peft_model, save_peft

    import kvlm.lora.adapter as adapter_mod
    from kvlm.kernels.ggml_types import GGMLQuantizationType

    need_native()
    pm = peft_model(CFG, STATE, ALL_TARGETS, r=8, alpha=16.0, seed=20)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(p.bfloat16().float())
    folder = save_peft(pm, tmp_path / "d")

    def engine(fused: bool = True) -> Engine:
        eng = _engine(files)
        eng.load_lora("d", folder)
        if not fused:
            eng.runner.fused = None
        return eng

    prompts, loras = random_prompts(4, seed=31), ["d", None, "b", "d"]
    eng = engine()
    w = eng.loras.get("d").on(0, "qkv_proj")
    assert w.a.qtype == GGMLQuantizationType.F32 and w.bt.dtype == torch.bfloat16
    got = run_engine(eng, prompts, GREEDY, loras=loras)
    assert_identical(got, run_engine(engine(fused=False), prompts, GREEDY, loras=loras), "bf16: fused vs modules")
    assert_identical(({0: got[0][3]}, {0: got[1][3]}), run_engine(engine(), prompts[3:], GREEDY, loras=["d"]),
                     "bf16 adapter: batch vs alone")
    monkeypatch.setattr(adapter_mod, "compact", lambda w: w)  # the same values kept in float32
    f32 = engine()
    assert f32.loras.get("d").on(0, "qkv_proj").bt.dtype == torch.float32
    assert_identical(run_engine(f32, prompts, GREEDY, loras=loras), got, "bf16 vs float32 weights")
