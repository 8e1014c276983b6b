"""`RequestGrammar.greedy_pick`, the sampler's shortcut past the mask for greedy rows, is sound in every
state: where it names a token for a row whose unmasked argmax is t, the masked argmax is that token. So
for each t: a pick equal to t must be allowed by the mask, and a different pick (a forced token) must be
the mask's only token. Checked against the real mask for every vocabulary id, in the states of seeded
random walks under the mask (canonical and odd tokenizations alike), for JSON schemas, regex, choice and
Lark grammars, on SmolLM2's tokenizer and a GGUF-built one. The shortcut must also fire: a test that
never takes it could not fail."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_grammar import PERSON, tiny_tokenizer

from kvlm.sampling_params import StructuredOutputsParams as SO
from kvlm.structured.compiler import GrammarCompiler
from kvlm.structured.mask import allowed_tokens
from kvlm.tokenizer.tokenizer import Tokenizer

SPECS = [
    SO(json=PERSON),
    SO(json={"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                         "ok": {"type": "boolean"}},
                                        "required": ["id", "ok"], "additionalProperties": False}}),
    SO(json_object=True),
    SO(regex=r"[0-9]{3}-[a-z]+"),
    SO(choice=["yes", "no", "maybe so"]),
    SO(grammar='start: "SELECT " COL " FROM t"\nCOL: /[a-z]+/'),
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    from kvlm.loader.gguf import read_gguf
    from kvlm.tokenizer.cache import gguf_tokenizer

    return gguf_tokenizer(smollm2_gguf, read_gguf(smollm2_gguf)[1])


def check_walks(tok: Tokenizer, steps: int, walks: int) -> dict[str, int]:
    """Random walks under each spec's mask; in each state every id is checked. Returns how often each
    kind of pick occurred."""
    comp = GrammarCompiler(tok, tok.vocab_size)
    eos = frozenset(tok.eos_token_ids)
    seen = {"free": 0, "forced": 0, "none": 0}
    for s, spec in enumerate(SPECS):
        for w in range(walks):
            rng = random.Random(1000 * s + w)
            g = comp.request_grammar(spec)
            V = g.mask_words * 32
            for _ in range(steps):
                allowed = allowed_tokens(g.mask().unsqueeze(0).clone(), V)[0]
                ids = torch.nonzero(allowed).flatten().tolist()
                picks = [g.greedy_pick(t, eos) for t in range(V)]
                for t, p in enumerate(picks):
                    if p is None:
                        seen["none"] += 1
                    elif p == t:
                        seen["free"] += 1
                        assert allowed[t], (spec.kind, t)
                    else:
                        seen["forced"] += 1
                        assert ids == [p], (spec.kind, t, p, ids[:5])
                if g.is_stopped or not ids:
                    break
                nxt = [t for t in ids if t not in eos] or ids
                assert g.accept(rng.choice(nxt))
    return seen


def test_greedy_pick_matches_mask_tiny_gguf_tokenizer() -> None:
    seen = check_walks(tiny_tokenizer(), steps=24, walks=3)
    assert seen["free"] > 0 and seen["forced"] > 0 and seen["none"] > 0, seen


def test_greedy_pick_matches_mask_smollm2(smollm2_tokenizer: Tokenizer) -> None:
    seen = check_walks(smollm2_tokenizer, steps=12, walks=1)
    assert seen["free"] > 0 and seen["forced"] > 0, seen
