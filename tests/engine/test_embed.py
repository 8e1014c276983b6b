"""Embeddings (`LLM.embed`, engine/pooling.py): prompt-only requests pooled from the final-norm hidden states.

Bit-identical alone and in a batch of 16 (chunked across steps), equal to Hugging Face transformers'
pooled `last_hidden_state` within 1e-4 on the float32 path, and no KV block held or cached afterwards.
"""

from __future__ import annotations

import json

import pytest
import torch
from deps import need, need_native
from tiny_models import hf_reference_model, random_state_dict, tiny_config, write_tiny_hf_dir

from kvlm import LLM
from kvlm.engine.pooling import ModelPooling, pool
from kvlm.errors import ParameterError, PromptTooLongError
from kvlm.sampling_params import PoolingParams, SamplingParams

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "hello " * 30,
         "embeddings pool the final hidden states", "x y z", "one more text, with punctuation!", "hello hello",
         "abc " * 12, "q", "The rain in Spain", "0123456789", "tiny model", "last and mean", "cls pooling", "end"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config()
    state = random_state_dict(cfg)
    path = write_tiny_hf_dir(tmp_path_factory.mktemp("embed") / "model", cfg, state)
    # a 32-token step budget: in the batch of 16 the longer prompts are split into chunks across steps
    llm = LLM(str(path), dtype="float32", num_threads=2, max_num_batched_tokens=32, block_size=4)
    return llm, cfg, state, path


def _vec(out) -> torch.Tensor:
    return torch.tensor(out.outputs.embedding)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_alone_equals_batch_of_16_bit_for_bit(tiny, pooling):
    need_native()
    llm = tiny[0]
    assert len(TEXTS) == 16
    batch = llm.embed(TEXTS, pooling=pooling)
    for text, out in zip(TEXTS, batch):
        assert torch.equal(_vec(llm.embed(text, pooling=pooling)[0]), _vec(out)), text
    assert batch[3].prompt_token_ids == llm.tokenizer.encode(TEXTS[3])


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_equals_transformers_pooled_hidden_states(tiny, pooling):
    need("transformers")
    llm, cfg, state, _ = tiny
    hf = hf_reference_model(cfg, state).model  # LlamaModel: last_hidden_state is after the final norm
    outs = llm.embed(TEXTS[:6], pooling=pooling)
    raw = llm.embed(TEXTS[:6], pooling=pooling, normalize=False)
    for text, out, r in zip(TEXTS[:6], outs, raw):
        with torch.no_grad():
            h = hf(torch.tensor([llm.tokenizer.encode(text)])).last_hidden_state[0]  # (T, hidden)
        want = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
        torch.testing.assert_close(_vec(r), want, atol=1e-4, rtol=0)
        torch.testing.assert_close(_vec(out), torch.nn.functional.normalize(want, dim=-1), atol=1e-4, rtol=0)
        assert abs(_vec(out).norm().item() - 1) < 1e-6


def test_no_block_is_held_or_cached_afterwards(tiny):
    llm = tiny[0]
    eng = llm.llm_engine
    bm = eng.block_manager
    llm.generate("hello world, a prompt that fills a few blocks", use_tqdm=False)  # something in the prefix cache
    cached, queries = bm.num_cached_blocks, eng.scheduler.prefix_cache_queries
    outs = llm.embed(TEXTS)
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == cached  # freed at once, nothing registered
    assert eng.scheduler.prefix_cache_queries == queries and not eng.requests
    again = llm.embed(TEXTS[1])[0]  # nothing reused: the same text is prefilled again, to the same bits
    assert again.metrics.num_cached_tokens == 0 and again.metrics.num_prefilled_tokens == len(again.prompt_token_ids)
    assert torch.equal(_vec(again), _vec(outs[1]))
    assert again.metrics.num_generated_tokens == 0 and again.metrics.first_token_time is None


def test_token_ids_context_and_bad_input(tiny):
    llm = tiny[0]
    ids = llm.tokenizer.encode(TEXTS[1])
    assert torch.equal(_vec(llm.embed(ids)[0]), _vec(llm.embed(TEXTS[1])[0]))
    assert [o.outputs.hidden_size for o in llm.embed([ids, ids[:3]])] == [64, 64]
    n = llm.llm_engine.max_model_len
    assert len(llm.embed([[5] * n])[0].outputs.embedding) == 64  # no output token: the whole context is the prompt
    with pytest.raises(PromptTooLongError):
        llm.embed([[5] * (n + 1)])
    with pytest.raises(ParameterError, match="pooling must be one of"):
        llm.embed("x", pooling="max")
    with pytest.raises(ParameterError, match="Matryoshka") as e:
        llm.embed("x", dimensions=8)
    assert e.value.param == "dimensions"
    with pytest.raises(ParameterError, match="empty"):
        llm.embed([[]])
    assert llm.llm_engine.block_manager.num_used_blocks == 0 and not llm.llm_engine.requests


def test_model_pooling_from_sentence_transformers_files(tmp_path):
    folder = tmp_path / "st"
    (folder / "pool").mkdir(parents=True)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "pool", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": False,
                                                              "pooling_mode_mean_tokens": True}))
    (folder / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 32]}))
    mp = ModelPooling.of(folder, 64)
    assert (mp.default, mp.source) == ("mean", "sentence-transformers config")
    assert ModelPooling.of(folder, 64, "last").default == "last"  # --pooling wins
    assert mp.resolve(PoolingParams(dimensions=16)) == PoolingParams("mean", True, 16)
    with pytest.raises(ParameterError, match=r"one of \[16, 32\]"):
        mp.resolve(PoolingParams(dimensions=8))
    (folder / "pool" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert ModelPooling.of(folder, 64).default == "last"
    (folder / "modules.json").unlink()
    assert ModelPooling.of(folder, 64).source == "default"  # no 1_Pooling/: the causal model's last token


def test_matryoshka_truncates_then_normalizes():
    rows = torch.randn(5, 64)
    full = pool(rows, PoolingParams("mean", False))
    torch.testing.assert_close(pool(rows, PoolingParams("mean", True, 16)),
                               torch.nn.functional.normalize(full[:16], dim=-1), atol=0, rtol=0)


def test_preempted_embeddings_recompute_to_the_same_bits(tiny):
    need_native()
    llm, _, _, path = tiny
    # A 32-block pool and a 16-token step budget: decoding requests and long prompts in chunks run out of
    # blocks, and the most recently admitted (here embeddings) are preempted and start their prompt again.
    small = LLM(str(path), dtype="float32", num_threads=2, max_num_batched_tokens=16, block_size=4,
                kv_cache_memory=32 * 4 * llm.llm_engine.kv_bytes_per_token, max_model_len=128)
    eng = small.llm_engine
    for i in range(3):
        eng.add_request(f"prompt {i}", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    texts = ["abc " * 20, "hello world " * 8, "the quick brown fox " * 5]
    embs = [eng.add_request(t, PoolingParams("mean")) for t in texts]
    while eng.has_unfinished:
        eng.step()
    assert sum(r.metrics.num_preemptions for r in embs) > 0
    for r, want in zip(embs, llm.embed(texts, pooling="mean")):
        assert torch.equal(r.embedding, _vec(want))
    assert eng.block_manager.num_used_blocks == 0
