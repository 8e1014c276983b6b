"""Weights in 2 MiB pages (`loader.huge_pages`): the loader copies every matrix a decode step reads into one
buffer, 2 MiB aligned and advised MADV_HUGEPAGE, with the bits of the file's mapping on every path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_runs import assert_identical, random_prompts, run_engine
from quantize import write_tiny_q4k_gguf

from kvlm import EngineConfig, SamplingParams
from kvlm.engine.engine import Engine
from kvlm.kernels import QuantTensor
from kvlm.kernels.panels import unpack
from kvlm.loader import huge_pages
from kvlm.loader.gguf import load_gguf

pytestmark = pytest.mark.skipif(not huge_pages.enabled(), reason="no transparent huge pages here (not Linux, "
                                "or /sys/kernel/mm/transparent_hugepage/enabled is [never])")


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding addr (/proc/self/smaps): 'hg' means advised MADV_HUGEPAGE."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"{addr:#x} is in no mapping")


def test_empty_is_aligned_advised_and_plain_when_off(monkeypatch: pytest.MonkeyPatch) -> None:
    t = huge_pages.empty(3 << 20)
    assert t.dtype == torch.uint8 and t.numel() == 3 << 20 and t.data_ptr() % huge_pages.HUGE == 0
    assert "hg" in _vm_flags(t.data_ptr())
    t.fill_(7)  # writable, and alive after the function's own references went
    assert int(t[-1]) == 7
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.worth(1 << 30)
    assert "hg" not in _vm_flags(huge_pages.empty(3 << 20).data_ptr())


@pytest.fixture(scope="module")
def q4k_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_K matrices (packed in panels where the kernel reads them), the head tied to the embedding."""
    return write_tiny_q4k_gguf(tmp_path_factory.mktemp("huge") / "tiny-Q4_K.gguf")


def test_loader_places_every_matrix_in_one_advised_buffer(q4k_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)  # the tiny model is under 2 MiB
    _, state, _ = load_gguf(q4k_gguf, quantized=True)
    mats = {k: v for k, v in state.items() if isinstance(v, QuantTensor)}
    storages = {v.data.untyped_storage().data_ptr() for v in mats.values()}
    assert len(storages) == 1, "one buffer"
    base = storages.pop()
    assert base % huge_pages.HUGE == 0 and "hg" in _vm_flags(base)
    assert "model.embed_tokens.weight" in mats and not mats["model.embed_tokens.weight"].panels  # tied: read whole
    monkeypatch.setenv(huge_pages.ENV, "0")
    _, plain, _ = load_gguf(q4k_gguf, quantized=True)
    assert len({v.data.untyped_storage().data_ptr() for k, v in plain.items() if isinstance(v, QuantTensor)}) > 1
    for k, v in mats.items():
        assert torch.equal(unpack(v).data, unpack(plain[k]).data), k


def test_engine_bits_in_huge_pages_and_in_the_mapped_file(q4k_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy logits of a batch, chunked and whole, and with the weights left in the mapped file: the same bits."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(4, 5, lo=3, hi=60)

    def run(**cfg) -> tuple[dict, dict]:
        return run_engine(Engine(q4k_gguf, EngineConfig(**cfg), quiet=True), prompts, params)
    ref = run(block_size=4)
    assert_identical(ref, run(block_size=4, max_num_batched_tokens=7), "huge pages, chunked")
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert_identical(ref, run(block_size=4), "huge pages vs the mapped file")
