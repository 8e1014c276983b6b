"""The KV pool is a limit, not an up-front cost: memory follows the tokens written, and slots never
written (which may hold anything, NaN included) never reach an attention output."""

from __future__ import annotations

import torch

from kvlm.attention import attention
from kvlm.attention.metadata import AttentionMetadata, GatheredRows, StepKind, build_attn_mask
from kvlm.kv_cache.spec import KVCacheConfig
from kvlm.kv_cache.storage import ContiguousKVCache, PagedKVCache, kv_format

F32 = kv_format(torch.float32)


def paged(layers: int, blocks: int, bs: int, kvh: int, D: int) -> PagedKVCache:
    """A float32 paged cache of full-attention layers."""
    return PagedKVCache(KVCacheConfig.full(F32, layers, blocks, bs, kvh, D), torch.device("cpu"))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_pool_memory_follows_tokens_not_limit() -> None:
    layers, blocks, bs, kvh, D = 4, 4096, 16, 4, 64  # 4096 blocks x 16 tokens x 2 KiB x 4 layers = 512 MiB
    before = rss_bytes()
    cache = paged(layers, blocks, bs, kvh, D)
    allocated = rss_bytes() - before
    assert cache.nbytes == 2 * layers * blocks * bs * kvh * D * 4
    assert allocated < cache.nbytes // 16, f"{allocated / 2**20:.0f} MiB resident for an empty pool"
    # Write 64 blocks' worth of tokens in every layer: resident memory grows by about their size.
    T = 64 * bs
    meta = AttentionMetadata(kind=StepKind.PREFILL, positions=torch.arange(T), slots=(torch.arange(T),),
                             tables=(torch.arange(64)[None],), query_lens=(T,), seq_lens=(T,),
                             logits_indices=torch.tensor([T - 1]), attn=GatheredRows(None, None))
    k = torch.randn(T, kvh, D)
    for layer in range(layers):
        cache.write(layer, k, k, meta)
    grown = rss_bytes() - before
    written = 2 * layers * T * kvh * D * 4
    assert grown < 2 * written + (16 << 20), f"{grown / 2**20:.0f} MiB resident after {written / 2**20:.0f} MiB"


def _meta(lens: list[int], bs: int) -> AttentionMetadata:
    """A decode step of len(lens) sequences; sequence b owns blocks b*8 .. b*8+7."""
    B = len(lens)
    tables = torch.tensor([[b * 8 + j for j in range(8)] for b in range(B)])
    slots = torch.tensor([int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(lens)])
    return AttentionMetadata(kind=StepKind.DECODE, positions=torch.tensor(lens) - 1, slots=(slots,),
                             tables=(tables,), query_lens=(1,) * B, seq_lens=tuple(lens),
                             logits_indices=torch.arange(B),
                             attn=GatheredRows(None, build_attn_mask([1] * B, lens, torch.device("cpu"))))


def test_unwritten_slots_never_reach_attention() -> None:
    """Fill the pools with NaN (what untouched memory could hold), write each sequence's tokens, and
    attend over a batch of different lengths: the output is finite and equals a zero-filled pool's."""
    bs, kvh, D, nh = 4, 2, 8, 4
    lens = [3, 9, 17]
    g = torch.Generator().manual_seed(0)
    outs = []
    for fill in (float("nan"), 0.0):
        for cache in (paged(1, 32, bs, kvh, D),
                      ContiguousKVCache(KVCacheConfig.full(F32, 1, 3, 32, kvh, D), torch.device("cpu"))):
            cache.k[0].fill_(fill)
            cache.v[0].fill_(fill)
            g.manual_seed(0)
            for b, n in enumerate(lens):  # prefill each sequence's history
                step = n
                if isinstance(cache, PagedKVCache):
                    slots = torch.tensor([(b * 8 + p // bs) * bs + p % bs for p in range(step)])
                else:
                    slots = torch.tensor([b * 32 + p for p in range(step)])
                kv = torch.randn(step, kvh, D, generator=g)
                m = AttentionMetadata(kind=StepKind.PREFILL, positions=torch.arange(step), slots=(slots,),
                                      tables=(torch.zeros(1, 1),), query_lens=(step,), seq_lens=(step,),
                                      logits_indices=torch.tensor([step - 1]), attn=GatheredRows(None, None))
                cache.write(0, kv, kv * 0.5, m)
            meta = _meta(lens, bs) if isinstance(cache, PagedKVCache) else AttentionMetadata(
                kind=StepKind.DECODE, positions=torch.tensor(lens) - 1, slots=(torch.zeros(3, dtype=torch.long),),
                tables=(torch.arange(3)[:, None],), query_lens=(1, 1, 1), seq_lens=tuple(lens),
                logits_indices=torch.arange(3),
                attn=GatheredRows(None, build_attn_mask([1, 1, 1], lens, torch.device("cpu"))))
            kk, vv = cache.fetch(0, meta)
            q = torch.randn(3, nh, D, generator=torch.Generator().manual_seed(1))
            out = attention(q, kk, vv, meta, D**-0.5)
            assert torch.isfinite(out).all(), type(cache).__name__
            outs.append(out)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    torch.testing.assert_close(outs[0], outs[1])


def test_resident_bytes_counts_the_pages_written() -> None:
    cache = paged(2, 2048, 16, 4, 64)  # 128 MiB reserved
    assert cache.resident_bytes is not None and cache.resident_bytes < (1 << 20)
    T = 32 * 16  # 32 blocks of 4 KiB per layer and tensor: 512 KiB in all
    meta = AttentionMetadata(kind=StepKind.PREFILL, positions=torch.arange(T), slots=(torch.arange(T),),
                             tables=(torch.arange(32)[None],), query_lens=(T,), seq_lens=(T,),
                             logits_indices=torch.tensor([T - 1]), attn=GatheredRows(None, None))
    k = torch.randn(T, 4, 64)
    for layer in range(2):
        cache.write(layer, k, k, meta)
    written = 2 * 2 * T * 4 * 64 * 4
    # Transparent huge pages may make up to 2 MiB resident per touched tensor.
    assert written <= cache.resident_bytes <= written + 4 * (2 << 20)


def _resident_mib(line: str) -> float:
    return float(line.split(" reserved, ")[1].split(" MiB resident now")[0])


def test_pool_log_line_says_reserved_and_resident(tiny_gguf) -> None:
    from kvlm import LLM, SamplingParams

    llm = LLM(str(tiny_gguf), kv_cache_memory=64 << 20, quiet=True)
    engine = llm.llm_engine
    line = engine.describe_cache()
    assert f"{engine.kv_cache.nbytes / 2**20:.1f} MiB reserved" in line
    assert _resident_mib(line) < 8 and "(it grows as tokens are written)" in line  # 64 MiB, nothing written yet
    llm.generate([{"prompt_token_ids": list(range(1, 200))}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert _resident_mib(engine.describe_cache()) > _resident_mib(line)  # said now, not at start
