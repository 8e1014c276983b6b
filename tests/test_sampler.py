"""Tests for kvlm.sampler: greedy, seeded reproducibility and batch independence, top-k/top-p/min-p filters,
sampling frequencies, penalties (HF / OpenAI semantics) and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvlm.request import Request
from kvlm.sampler import apply_penalties, filter_logits, sample
from kvlm.sampling_params import SamplingParams


def make_req(seed: int | None = None, prompt: list[int] | None = None, outputs: list[int] | None = None,
             **kw: object) -> Request:
    prompt = [0] if prompt is None else prompt
    r = Request("r", prompt + list(outputs or []), len(prompt), SamplingParams(**kw))  # type: ignore[arg-type]
    if seed is not None:
        r.generator = torch.Generator().manual_seed(seed)
    return r


def rand_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draws(logits: torch.Tensor, reqs: list[Request], n: int) -> list[list[int]]:
    """n successive sample() calls on the same logits (each request's generator advances)."""
    return [sample(logits.clone(), reqs).token_ids for _ in range(n)]


def test_temperature_zero_is_argmax() -> None:
    """Greedy rows return the argmax of their row, whatever their other filters say."""
    logits = rand_logits(5, 50)
    reqs = [make_req(temperature=0.0), make_req(temperature=0.0, top_k=3), make_req(temperature=0.0, top_p=0.1),
            make_req(temperature=0.0, min_p=0.9), make_req(temperature=0.0, seed=1)]
    assert sample(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_top_k_one_is_argmax_for_every_seed() -> None:
    """top_k=1 at temperature 1 leaves one token, so every seed draws the argmax."""
    logits = rand_logits(1, 64, seed=3) / 3  # a fairly flat row, so a wrong filter would show
    best = int(logits.argmax())
    for s in range(200):
        assert sample(logits, [make_req(seed=s, top_k=1)]).token_ids == [best]


def test_same_seed_same_tokens() -> None:
    """Two requests with fresh generators of the same seed draw the same 20-token sequence."""
    logits = torch.zeros(1, 100)
    a = [t[0] for t in draws(logits, [make_req(seed=1234)], 20)]
    b = [t[0] for t in draws(logits, [make_req(seed=1234)], 20)]
    assert a == b


def test_different_seeds_different_tokens() -> None:
    """Different seeds give different sequences on a flat distribution (and use more than one token)."""
    logits = torch.zeros(1, 100)
    seqs = [tuple(t[0] for t in draws(logits, [make_req(seed=s)], 20)) for s in range(5)]
    assert len(set(seqs)) == 5
    assert all(len(set(s)) > 5 for s in seqs)


def test_row_draw_independent_of_batch() -> None:
    """A seeded row draws the same tokens alone and at index 2 of a batch of 4 with different params."""
    logits = rand_logits(4, 80, seed=7) / 4
    alone = [t[0] for t in draws(logits[2:3], [make_req(seed=99, top_p=0.9)], 20)]
    batch = [make_req(seed=5, top_k=5), make_req(temperature=0.0), make_req(seed=99, top_p=0.9),
             make_req(seed=6, temperature=1.7, min_p=0.05, repetition_penalty=1.3, prompt=[1, 2, 3])]
    together = [t[2] for t in draws(logits, batch, 20)]
    assert together == alone


def probs_row(p: list[float]) -> torch.Tensor:
    return torch.tensor([p]).log()


def kept(masked: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(masked[0])).flatten().tolist())


def filt(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    return filter_logits(logits, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))


@pytest.mark.parametrize(("top_p", "expected"), [
    (0.3, {2}), (0.5, {2}), (0.6, {2, 0}), (0.8, {2, 0}), (0.9, {2, 0, 3}), (0.97, {2, 0, 3, 1}), (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p: float, expected: set[int]) -> None:
    """top_p keeps the most likely tokens until their mass reaches top_p (always at least the top one)."""
    logits = probs_row([0.3, 0.04, 0.55, 0.11])  # sorted: 2 (.55), 0 (.30), 3 (.11), 1 (.04)
    out = filt(logits, top_p=top_p)
    assert kept(out) == expected
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)]), "kept logits must be unchanged"


@pytest.mark.parametrize(("min_p", "expected"), [
    (0.0, {0, 1, 2, 3}), (0.05, {0, 1, 2, 3}), (0.1, {0, 2, 3}), (0.5, {0, 2}), (0.6, {2}), (1.0, {2}),
])
def test_min_p_drops_tokens_below_fraction_of_top(min_p: float, expected: set[int]) -> None:
    """min_p removes tokens whose probability is below min_p x the top probability."""
    logits = probs_row([0.3, 0.04, 0.55, 0.11])  # ratios to top: .545, .073, 1, .2
    assert kept(filt(logits, min_p=min_p)) == expected


def test_top_k_keeps_k_largest() -> None:
    """top_k keeps exactly the k largest logits (0 disables)."""
    logits = rand_logits(1, 30, seed=11) / 3  # moderate spread: top_p=1 keeps every token here
    order = logits[0].argsort(descending=True).tolist()
    for k in (1, 2, 7, 30, 100):
        assert kept(filt(logits, top_k=k)) == set(order[:k])
    assert kept(filt(logits, top_k=0)) == set(range(30))


def test_top_p_one_keeps_every_token() -> None:
    """top_p=1.0 disables top-p: even very unlikely tokens stay sampleable."""
    assert kept(filt(torch.tensor([[0.0, -20.0]]), top_p=1.0)) == {0, 1}
    assert kept(filt(rand_logits(1, 30, seed=11), top_p=1.0)) == set(range(30))


def test_top_p_applies_after_top_k_like_vllm() -> None:
    """With both set, top-p works on the distribution renormalized over the top-k tokens (vLLM/HF order)."""
    logits = probs_row([0.4, 0.3, 0.2, 0.1])
    # After top_k=2: {0: .571, 1: .429}; top_p=0.5 is reached by token 0 alone.
    assert kept(filt(logits, top_k=2, top_p=0.5)) == {0}


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 0), (2.0, 0), (1.0, 2)])
def test_empirical_frequencies_match_softmax(temperature: float, top_k: int) -> None:
    """~4000 seeded draws follow softmax(logits / T) (renormalized over the top-k) within 0.03."""
    base = torch.tensor([1.0, 0.5, -0.5, 2.0])
    n = 4000
    reqs = [make_req(seed=10_000 + i, temperature=temperature, top_k=top_k) for i in range(n)]
    toks = sample(base.repeat(n, 1), reqs).token_ids
    z = base / temperature
    if top_k:
        z = torch.where(z >= z.topk(top_k).values[-1], z, torch.tensor(-math.inf))
    want = z.softmax(-1).tolist()
    freq = Counter(toks)
    for t in range(4):
        assert abs(freq[t] / n - want[t]) < 0.03, (t, freq[t] / n, want[t])


def test_repetition_penalty_hf_semantics() -> None:
    """Logits of tokens in prompt + output: positive ones divided by the penalty, negative ones multiplied."""
    logits = torch.tensor([[2.0, -1.0, 3.0, -0.5, 1.0, 0.0, 4.0, -2.0]])
    req = make_req(prompt=[0, 1, 0], outputs=[3, 4, 4], repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), [req])
    want = torch.tensor([[1.0, -2.0, 3.0, -1.0, 0.5, 0.0, 4.0, -2.0]])
    assert torch.allclose(out, want)


def test_repetition_penalty_changes_greedy_choice() -> None:
    """A greedy request avoids a repeated prompt token when the penalty pushes it below another token."""
    logits = torch.tensor([[0.0, 5.0, 3.0, -1.0]])
    assert sample(logits, [make_req(prompt=[1], temperature=0.0)]).token_ids == [1]
    assert sample(logits, [make_req(prompt=[1], temperature=0.0, repetition_penalty=2.0)]).token_ids == [2]
    assert torch.equal(logits, torch.tensor([[0.0, 5.0, 3.0, -1.0]])), "sample() must not modify its input"


def test_presence_and_frequency_penalties_count_output_only() -> None:
    """presence subtracts p once per distinct output token, frequency f per occurrence; prompt tokens are exempt."""
    logits = torch.zeros(1, 8)
    req = make_req(prompt=[1, 2, 2, 6], outputs=[5, 5, 5, 7, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), [req])[0]
    want = torch.zeros(8)
    want[5] = -(0.5 + 3 * 0.25)
    want[7] = -(0.5 + 0.25)
    want[2] = -(0.5 + 0.25)  # counted once: only its output occurrence
    assert torch.allclose(out, want)


def test_negative_presence_penalty_encourages() -> None:
    """A negative presence penalty raises the logits of tokens already generated."""
    out = apply_penalties(torch.zeros(1, 4), [make_req(prompt=[0], outputs=[3], presence_penalty=-1.0)])
    assert out[0].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_penalties_apply_per_row() -> None:
    """Each row is penalized with its own request's tokens and parameters only."""
    logits = torch.ones(2, 4)
    reqs = [make_req(prompt=[1], outputs=[2], repetition_penalty=2.0), make_req(prompt=[3], outputs=[0])]
    out = apply_penalties(logits.clone(), reqs)
    assert out[0].tolist() == [1.0, 0.5, 0.5, 1.0] and out[1].tolist() == [1.0] * 4


def test_logprobs_topk_plus_chosen_from_raw_logits() -> None:
    """logprobs=k gives the k most likely ids plus the chosen one, valued by log_softmax of the raw logits
    (before penalties and temperature)."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    raw = logits.log_softmax(-1)[0]
    # The penalty makes greedy pick token 3, which is outside the raw top 3.
    req = make_req(prompt=[0, 1, 2], temperature=0.0, repetition_penalty=100.0, logprobs=3)
    out = sample(logits.clone(), [req])
    assert out.token_ids == [3]
    lp = out.logprobs[0]
    assert lp is not None and set(lp) == {0, 1, 2, 3}
    for t, v in lp.items():
        assert v == pytest.approx(float(raw[t]), abs=1e-5)


def test_logprobs_zero_none_and_chosen_in_topk() -> None:
    """logprobs=0: only the chosen token; None: no dict; chosen inside the top k: exactly k entries."""
    logits = rand_logits(3, 20, seed=2)
    raw = logits.log_softmax(-1)
    reqs = [make_req(seed=1, logprobs=0), make_req(temperature=0.0), make_req(temperature=0.0, logprobs=5)]
    out = sample(logits, reqs)
    assert out.logprobs[1] is None
    assert out.logprobs[0] == pytest.approx({out.token_ids[0]: float(raw[0, out.token_ids[0]])})
    top5 = raw[2].topk(5)
    assert out.logprobs[2] == pytest.approx(dict(zip(top5.indices.tolist(), top5.values.tolist())))
    assert out.token_ids[2] in out.logprobs[2]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    """Before min_tokens outputs, EOS and stop_token_ids cannot be drawn, even when they dominate."""
    from kvlm.sampler import sample as _sample

    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], max_tokens=5)
    req = Request("r", [3], 1, params)
    assert _sample(logits.clone(), [req], frozenset({1})).token_ids == [3]
    req.token_ids += [3, 3]  # min_tokens reached: EOS allowed again
    assert _sample(logits.clone(), [req], frozenset({1})).token_ids == [1]
