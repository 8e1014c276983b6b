"""Q4_K weights packed in 16-row panels (`kernels.panels`, csrc/kernels_kquant_panels.h and _avx2.h): the file's
bytes in another order, read by the AVX-512 and AVX2 int8 kernels, with the bits of the file's layout on every
path; the loader packs them where that kernel runs and keeps the embedding table by row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deps import need_native
from engine_runs import assert_identical, random_prompts, run_engine
from gguf import GGMLQuantizationType as T
from quantize import random_blocks, write_tiny_q4k_gguf  # noqa: E402  (tests/helpers)
from test_kernels import int8_activation_cases

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.kernels import QuantTensor, dequantize, native, qmatmul
from kvlm.kernels.backend import ENV_PANELS, weight_panels
from kvlm.kernels.panels import pack, packable, unpack
from kvlm.loader.gguf import load_gguf


def test_pack_transposes_each_blocks_dwords_and_unpack_inverts_it() -> None:
    w = random_blocks(T.Q4_K, 48, 768, seed=3)  # 3 panels of 3 super-blocks
    p = pack(w)
    assert p.panels and p.shape == w.shape and p.data.shape == w.data.shape and p.type_id == int(T.Q4_K) | 0x100
    assert torch.equal(unpack(p).data, w.data) and not unpack(p).panels
    rows = w.data[16:32].contiguous().view(torch.int32).view(16, 3, 36)  # panel 1: (row c, block, dword i)
    got = p.data[16:32].reshape(-1).view(torch.int32).view(3, 36, 16)  # (block, dword i, row c)
    for b in range(3):
        assert torch.equal(got[b], rows[:, b].T), f"block {b}"


def test_native_pack_writes_the_strided_copys_bytes() -> None:
    need_native("pack_panels is a native op")
    w = random_blocks(T.Q4_K, 64, 1024, seed=9)
    want = torch.empty_like(w.data)
    want.view(torch.int32).view(4, 4, 36, 16).copy_(w.data.view(torch.int32).view(4, 16, 4, 36).permute(0, 2, 3, 1))
    assert torch.equal(pack(w).data, want)


def test_only_whole_panels_of_a_panel_format_pack() -> None:
    assert packable(random_blocks(T.Q4_K, 32, 256, seed=1))
    assert not packable(random_blocks(T.Q4_K, 37, 256, seed=1))  # a partial panel
    assert not packable(random_blocks(T.Q6_K, 32, 256, seed=1))  # no panel kernel for the format
    assert not packable(pack(random_blocks(T.Q4_K, 32, 256, seed=1)))  # packed already
    with pytest.raises(ValueError, match="16-row panels"):
        pack(random_blocks(T.Q4_K, 37, 256, seed=1))


def test_packed_weights_give_the_file_layouts_bits(isa: str) -> None:
    """Every M through each work order (in-register units for up to 4 rows, the panel buffer and its row tiles,
    AMX tiles from 32 rows; AVX2: both halves for up to 2 rows, a half at a time for 3 to 8, the two panel
    buffers past 8), from row 0 and row 5 (the edge rows elsewhere), at K = 768 and 2304. On a path without the
    panel kernel (scalar, NEON) qmatmul unpacks: the same bits again."""
    for k in (768, 2304):
        w = random_blocks(T.Q4_K, 48, k, seed=31)
        p = pack(w)
        x = int8_activation_cases(k, m=55, huge=1e30)
        want = qmatmul(x, w).view(torch.int32)
        for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 48, 50):
            for r0 in (0, 5):
                got = qmatmul(x[r0:r0 + m], p).view(torch.int32)
                assert torch.equal(got, want[r0:r0 + m]), f"K={k} M={m} from row {r0}"
        assert torch.equal(dequantize(p), dequantize(w))


def test_packed_merged_parts_and_views_of_whole_panels() -> None:
    """A row slice of whole panels is still packed panels (the loader's one buffer holds every matrix)."""
    w = random_blocks(T.Q4_K, 64, 256, seed=5)
    p = pack(w)
    half = QuantTensor(p.data[32:], T.Q4_K, (32, 256), panels=True)
    x = torch.randn(3, 256)
    assert torch.equal(qmatmul(x, half), qmatmul(x, QuantTensor(w.data[32:], T.Q4_K, (32, 256))))


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_q4k_gguf(tmp_path_factory.mktemp("panels") / "tiny-Q4_K.gguf")


def test_loader_packs_where_the_kernel_reads_panels(q4k_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    need_native()
    _, state, _ = load_gguf(q4k_gguf, quantized=True)
    mats = {k: v for k, v in state.items() if isinstance(v, QuantTensor)}
    packed = {k for k, v in mats.items() if v.panels}
    if not weight_panels():
        assert not packed, f"{native.active_isa()} has no panel kernel"
        return
    assert "model.embed_tokens.weight" not in packed  # a lookup reads it by row (and the head is tied to it)
    assert packed == {k for k, v in mats.items() if v.qtype == T.Q4_K and k != "model.embed_tokens.weight"}
    monkeypatch.setenv(ENV_PANELS, "0")
    _, plain, _ = load_gguf(q4k_gguf, quantized=True)
    for k in packed:
        assert not plain[k].panels and torch.equal(unpack(state[k]).data, plain[k].data), k


def test_engine_bits_with_and_without_panels(q4k_gguf: Path, monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Greedy logits of a batch, chunked and whole, and of a prompt alone: the same bits packed or not, on each
    path whose kernel reads panels (AVX-512's gemm_k4p, AVX2's gemm_k4p8)."""
    if not weight_panels():
        pytest.skip(f"{isa} reads no panels")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(4, 11, lo=3, hi=60)

    def run(**cfg) -> tuple[dict, dict]:
        return run_engine(Engine(q4k_gguf, EngineConfig(**cfg), quiet=True), prompts, params)
    ref = run(block_size=4)
    monkeypatch.setenv(ENV_PANELS, "0")
    assert_identical(ref, run(block_size=4), "packed vs the file's layout")
    assert_identical(ref, run(block_size=4, max_num_batched_tokens=7), "packed vs the file's layout, chunked")
