"""Tests for kvlm.engine.sampler: greedy, seeded reproducibility and batch independence, top-k/top-p/min-p filters,
sampling frequencies, penalties (HF / OpenAI semantics) and logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvlm.engine.sampler import apply_penalties, filter_logits, sample
from kvlm.request import Request
from kvlm.sampling_params import SamplingParams


def make_req(seed: int | None = None, prompt: list[int] | None = None, outputs: list[int] | None = None,
             **kw: object) -> Request:
    prompt = [0] if prompt is None else prompt
    r = Request("r", prompt + list(outputs or []), len(prompt), SamplingParams(**kw))  # type: ignore[arg-type]
    if seed is not None:
        r.seed = seed
    return r


def rand_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draws(logits: torch.Tensor, reqs: list[Request], n: int) -> list[list[int]]:
    """n successive sample() calls on the same logits, each request taking its token (its position advances,
    and with it the key of its next draw)."""
    out = []
    for _ in range(n):
        toks = sample(logits.clone(), reqs).token_ids
        for r, t in zip(reqs, toks):
            r.token_ids.append(t)
        out.append(toks)
    return out


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


def expected_probs(logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> list[float]:
    """vLLM V1's distribution written out independently, in float64 Python: softmax(logits / T), then
    min-p, then top-k (ties with the k-th kept), then top-p by descending position, renormalized."""
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    s = sum(p)
    p = [x / s for x in p]
    keep = [x >= min_p * max(p) for x in p]
    if top_k:
        kth = sorted((z[i] for i in range(len(z)) if keep[i]), reverse=True)[min(top_k, sum(keep)) - 1]
        keep = [k and z[i] >= kth for i, k in enumerate(keep)]
    mass = sum(p[i] for i in range(len(p)) if keep[i])
    before = 0.0
    for i in sorted(range(len(p)), key=lambda i: (-p[i], -i)):  # ties: higher id first, as vLLM
        if keep[i]:
            if before >= top_p:
                keep[i] = False
            before += p[i] / mass
    total = sum(p[i] for i in range(len(p)) if keep[i])
    return [p[i] / total if keep[i] else 0.0 for i in range(len(p))]


def chi2_critical(dof: int, z: float = 4.26) -> float:
    """Upper quantile of chi-square(dof) by Wilson-Hilferty; z=4.26 is p ~ 1e-5 (a fixed seed makes the
    test deterministic; the bound only decides how wrong a sampler may be and still pass)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


# Token 5 has probability ~2% at T=1; tokens 1 and 2 are tied.
BASE = [2.0, 1.0, 1.0, 0.2, -0.3, -0.6, 2.6, -3.0]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (2.0, 3, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (1.5, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1), (0.6, 0, 1.0, 0.1), (1.3, 0, 0.7, 0.2), (0.8, 4, 0.9, 0.05), (1.0, 2, 1.0, 0.0),
])
def test_empirical_frequencies_match_vllm_distribution(temperature: float, top_k: int, top_p: float,
                                                        min_p: float) -> None:
    """20,000 seeded draws pass a chi-square test against vLLM's distribution (computed independently),
    every token's count is within 5 sigma of its binomial mean, and filtered tokens never appear."""
    want = expected_probs(BASE, temperature, top_k, top_p, min_p)
    n = 20_000
    reqs = [make_req(seed=50_000 + i, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            for i in range(n)]
    freq = Counter(sample(torch.tensor(BASE).repeat(n, 1), reqs).token_ids)
    support = [t for t, q in enumerate(want) if q > 0]
    assert set(freq) <= set(support), (freq, want)
    for t in support:
        sd = math.sqrt(n * want[t] * (1 - want[t]))
        assert abs(freq[t] - n * want[t]) <= 5 * sd + 1, (t, freq[t], n * want[t])
    if len(support) > 1:
        chi2 = sum((freq[t] - n * want[t]) ** 2 / (n * want[t]) for t in support)
        assert chi2 < chi2_critical(len(support) - 1), (chi2, freq, want)


def test_frequency_test_catches_a_sampler_that_drops_a_rare_token() -> None:
    """The statistics above bite: a distribution missing the 2% token fails the same chi-square bound."""
    want = expected_probs(BASE)
    assert 0.015 < want[5] < 0.03
    n = 20_000
    counts = [round(n * q) for q in want]
    counts[0] += counts[5]
    counts[5] = 0
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, want))
    assert chi2 > chi2_critical(len(want) - 1)


def test_min_p_comes_before_top_p_like_vllm() -> None:
    """vLLM V1 applies min-p first and top-p on what it leaves: [.5, .3, .15, .05] with min_p=.35 keeps
    {.5, .3}, renormalized to {.625, .375}; top_p=.6 then keeps only the first (top-p first would keep two)."""
    assert kept(filt(probs_row([0.5, 0.3, 0.15, 0.05]), top_p=0.6, min_p=0.35)) == {0}


def test_top_p_cuts_ties_by_position_like_vllm() -> None:
    """[.4, .3, .3] with top_p=.5: vLLM keeps two tokens (cut by sorted position), not all three tied ones;
    of the tied pair, the higher id survives (stable ascending sort drops the lower id first)."""
    assert kept(filt(probs_row([0.4, 0.3, 0.3]), top_p=0.5)) == {0, 2}


def test_top_k_keeps_ties_with_the_kth_like_vllm() -> None:
    """vLLM's top-k masks logits below the k-th value, so tokens tied with it stay."""
    assert kept(filt(probs_row([0.4, 0.3, 0.3]), top_k=2)) == {0, 1, 2}
    assert kept(filt(probs_row([0.4, 0.3, 0.2, 0.1]), top_k=2)) == {0, 1}


@pytest.mark.parametrize("temperature", [9.9e-6, 1e-8, 1e-40, 1e-45, 5e-324])
def test_temperature_below_1e_5_is_greedy_and_ignores_filters(temperature: float) -> None:
    """Below vLLM's 1e-5 the row is greedy: the argmax, whatever top-k/top-p/min-p say, never a crash."""
    logits = rand_logits(3, 50, seed=4) * 10
    reqs = [make_req(seed=i, temperature=temperature, top_k=3, top_p=0.2, min_p=0.5) for i in range(3)]
    assert all(r.params.greedy for r in reqs)
    assert sample(logits, reqs).token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-5, 3e-5, 1e-3])
def test_tiny_sampling_temperature_does_not_overflow(temperature: float) -> None:
    """Just above the greedy threshold, logits / T would overflow float32 for large logits; the sampler
    still returns the argmax of a near-one-hot distribution, never NaN or an out-of-range id."""
    logits = torch.tensor([[1.99e34, 2e34, -1e34, 0.0], [3.0, 2.0, 5.0, 4.9]])  # 2e34 / 1e-5 > float32 max
    for s in range(20):
        out = sample(logits.clone(), [make_req(seed=s, temperature=temperature),
                                      make_req(seed=s, temperature=temperature)]).token_ids
        assert out == [1, 2]


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
    from kvlm.engine.sampler import sample as _sample

    logits = torch.tensor([[0.0, 10.0, 9.0, 1.0]])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], max_tokens=5)
    req = Request("r", [3], 1, params)
    assert _sample(logits.clone(), [req], frozenset({1})).token_ids == [3]
    req.token_ids += [3, 3]  # min_tokens reached: EOS allowed again
    assert _sample(logits.clone(), [req], frozenset({1})).token_ids == [1]


def test_top_k_fast_path_makes_the_full_sorts_cuts() -> None:
    """With a small top-k on every row the sampler never sorts the vocabulary; its cuts (ties included:
    logits on a coarse grid) are the full sort's, with and without top-p."""
    from kvlm.engine.sampler import _sorted_cuts, _top_k_then_top_p

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 4096, generator=g) * 4).round() / 2  # many ties
    logits[5, :4000] = float("-inf")  # a row that min-p already cut to 96 tokens
    top_k = torch.tensor([1, 5, 40, 40, 200, 500])
    for top_p in (torch.ones(6), torch.tensor([0.9, 0.5, 0.95, 0.1, 0.99, 0.8])):
        assert torch.equal(_top_k_then_top_p(logits, top_k, top_p), _sorted_cuts(logits, top_k, top_p))
    # Neither top-k nor top-p: no sort at all, and the same distribution as the full sort's cuts.
    off, p1 = torch.zeros(6, dtype=torch.long), torch.ones(6)
    fast = filter_logits(logits, off, p1, torch.zeros(6)).softmax(-1)
    assert torch.equal(fast, _sorted_cuts(logits, off, p1).softmax(-1))


def test_draw_is_keyed_by_seed_and_position() -> None:
    """A row's draw depends on (seed, position of the token drawn) only: the same request sampled twice at
    the same length draws the same token; a row verifying drafts (offset j) draws what the request would
    draw once those drafts were its tokens; another position or seed draws differently."""
    logits = torch.zeros(1, 1000)
    a, b = make_req(seed=3, temperature=1.0), make_req(seed=3, temperature=1.0)
    assert sample(logits, [a]).token_ids == sample(logits, [a]).token_ids == sample(logits, [b]).token_ids
    a.draft_token_ids = [5, 6]
    spec = sample(logits.repeat(3, 1), [a, a, a], offsets=[0, 1, 2]).token_ids
    one_by_one = []
    for t in (None, 5, 6):
        if t is not None:
            b.token_ids.append(t)
        one_by_one += sample(logits, [b]).token_ids
    assert spec == one_by_one and len(set(spec)) == 3
    assert sample(logits, [make_req(seed=4, temperature=1.0)]).token_ids != sample(logits, [a]).token_ids


def test_penalties_and_min_tokens_see_each_rows_history() -> None:
    """Verify rows apply penalties and min_tokens as if their drafts had been decoded one by one."""
    kw = dict(temperature=0.0, frequency_penalty=2.0, min_tokens=2, prompt=[0])
    logits = torch.tensor([[0.0, 3.0, 2.0, 9.0]])  # token 3 plays EOS
    r = make_req(**kw)
    r.draft_token_ids = [1, 2]
    spec = sample(logits.repeat(3, 1), [r, r, r], frozenset({3}), offsets=[0, 1, 2]).token_ids
    one = make_req(**kw)
    ref = []
    for t in (None, 1, 2):
        if t is not None:
            one.token_ids.append(t)
        ref += sample(logits, [one], frozenset({3})).token_ids
    assert spec == ref == [1, 2, 3]
