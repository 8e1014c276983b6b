"""`SamplingParams`: how one request picks its tokens and when it stops (vLLM semantics); `PoolingParams`:
what a prompt-only request (an embedding) returns instead of tokens.

This is the one place where sampling options are validated: the CLI, the Python API and the server
all construct a `SamplingParams`, so each gets the same checks and messages. An invalid value raises
`ParameterError` (a `ValueError`) whose `.param` is the field's API name and whose message starts with
it ("top_p must be in (0, 1], got 0.0"), so it reads well on a command line and in an HTTP 400 body.
Ranges are vLLM's. Checks that need the vocabulary (stop_token_ids below the vocab size) are made
where the vocabulary is known: `Engine.add_request`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvlm.errors import ParameterError

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would
# only turn the distribution into a numerically fragile one-hot anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
SEED_RANGE = (-(2**63), 2**63 - 1)  # a signed 64-bit integer, as vLLM's API and torch accept


def _show(value: Any) -> str:
    """repr() of a bad value, shortened so a huge int or a long string still gives one readable line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`); set exactly one of:

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output must match; choice: the output is exactly one of these strings;
    grammar: a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's).
    whitespace_pattern: a regex for the whitespace JSON may hold between tokens. None (the default) means
    compact JSON, no whitespace at all, so a small model cannot pad its answer out to max_tokens.
    The schema or grammar is checked when it is compiled (`kvlm.structured`); a bad one is a
    `ParameterError` naming `structured_outputs`.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        def bad(rule: str) -> ParameterError:
            return ParameterError("structured_outputs", f"structured_outputs {rule}")

        given = [k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise bad(f"must set exactly one of {', '.join(GRAMMAR_KINDS)}; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise bad(f"json must be a JSON schema (an object or its text), got {type(self.json).__name__}")
        if self.json_object is not False and self.json_object is not True:
            raise bad("json_object must be true or false")
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or (name != "whitespace_pattern" and not v)):
                raise bad(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or any(not isinstance(c, str) or not c for c in self.choice)):
                raise bad("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `GRAMMAR_KINDS`."""
        return next(k for k in GRAMMAR_KINDS if getattr(self, k) not in (None, False))


POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """A prompt-only request (vLLM's `PoolingParams`): its prompt is prefilled, no token is sampled, and the
    final-norm hidden states of its rows are pooled into one vector (`kvlm.engine.pooling`).

    pooling: "last" (the last prompt row: what a causal model has seen of the whole text), "mean" (every
    row averaged) or "cls" (the first row); None: the model's default (its sentence-transformers pooling
    config, else "last", or the engine's `pooling` setting). normalize: scale to unit L2 norm (OpenAI's
    embeddings are). dimensions: keep the first this many values, then normalize again (Matryoshka
    models only: the engine, which knows the model, refuses it elsewhere).
    """

    pooling: str | None = None
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ParameterError("pooling", f"pooling must be one of {', '.join(POOLING_TYPES)}, "
                                            f"got {_show(self.pooling)}")
        if self.normalize is not True and self.normalize is not False:
            raise ParameterError("normalize", f"normalize must be true or false, got {_show(self.normalize)}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ParameterError("dimensions", f"dimensions must be a positive integer, got {_show(self.dimensions)}")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping options.

    temperature: below 1e-5 means greedy (argmax; top-k, top-p and min-p are then ignored). top_k: 0 or
    -1 disables. top_p in (0, 1]. min_p in [0, 1]: drop tokens whose probability is below min_p x the
    top probability. The sampler applies them in vLLM V1's order (see `kvlm.engine.sampler`).
    repetition_penalty (HF semantics, over prompt and output): positive logits are divided by it,
    negative ones multiplied. presence_penalty and frequency_penalty (OpenAI semantics, over output
    tokens): subtract p * [count > 0] and f * count.
    seed: a per-request generator, so the same seed gives the same tokens whatever else is batched
    (-1 means no seed, as in vLLM).
    stop: strings that end generation; they are excluded from the text and never streamed in part.
    logprobs: how many top alternatives to return per generated token (None: none).
    prompt_logprobs: the same for each prompt token (the first has none); such a request computes its
    whole prompt (it takes no cached prefix), as in vLLM.
    n: must be 1 here; a server fans several completions out into several requests.
    structured_outputs: constrain the output to a JSON schema, any JSON object, a regex, one of a list of
    strings or a Lark/GBNF grammar (`StructuredOutputsParams`); EOS is allowed only where the grammar
    accepts. It cannot be combined with min_tokens or ignore_eos (either could forbid the only token the
    grammar allows).
    max_kv_tokens, sink_tokens: a bounded KV cache for this request (None: the engine's setting): keep
    the first sink_tokens tokens and the most recent ones, at most max_kv_tokens, so a chat or a
    generation runs past the context with flat memory (`kvlm.kv_policy`); max_tokens None then means up
    to the context length of new tokens.
    reasoning: the request may think first: its `<think>` span (when the prompt leaves one open) is tracked,
    and a grammar (structured_outputs) applies only from the token after `</think>` (vLLM's behaviour with a
    reasoning parser), so a thinking model reasons freely and then answers in the constrained form.
    reasoning_budget: at most this many tokens inside `<think>...</think>`; once spent, the engine forces
    `</think>` (`kvlm.structured.reasoning_budget`). None: no budget. Implies `reasoning`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI), in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    max_kv_tokens: int | None = None  # a bounded cache: at most this many tokens' K/V kept
    sink_tokens: int | None = None  # with max_kv_tokens: leading tokens always kept (None: the engine's, 4)
    reasoning: bool = False  # track a `<think>` span the prompt opened; a grammar waits for its end
    reasoning_budget: int | None = None  # reasoning tokens before `</think>` is forced (None: no budget)
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ParameterError:
            return ParameterError(name, f"{name} {rule}, got {_show(getattr(self, name))}")

        def number(name: str, rule: str, ok: Any) -> None:
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v) or not ok(v):
                raise bad(name, rule)

        def integer(name: str, rule: str, ok: Any, optional: bool = False) -> None:
            v = getattr(self, name)
            if optional and v is None:
                return
            if not _is_int(v) or not ok(v):
                raise bad(name, rule)

        integer("n", "must be 1 (a server asks for several completions as several requests)", lambda v: v == 1)
        number("temperature", "must be a finite number >= 0", lambda v: v >= 0)
        number("top_p", "must be a number in (0, 1]", lambda v: 0 < v <= 1)
        integer("top_k", "must be -1 or 0 (disabled) or a positive integer", lambda v: v >= -1)
        number("min_p", "must be a number in [0, 1]", lambda v: 0 <= v <= 1)
        number("repetition_penalty", "must be a finite number > 0", lambda v: v > 0)
        number("presence_penalty", "must be a number in [-2, 2]", lambda v: -2 <= v <= 2)
        number("frequency_penalty", "must be a number in [-2, 2]", lambda v: -2 <= v <= 2)
        integer("seed", f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
                lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1], optional=True)
        integer("max_tokens", "must be a positive integer or None", lambda v: v >= 1, optional=True)
        integer("min_tokens", "must be an integer in [0, max_tokens]",
                lambda v: 0 <= v and (self.max_tokens is None or v <= self.max_tokens))
        integer("max_kv_tokens", "must be a positive integer or None", lambda v: v >= 1, optional=True)
        integer("sink_tokens", "must be an integer >= 0 or None", lambda v: v >= 0, optional=True)
        integer("reasoning_budget", "must be an integer >= 0 or None", lambda v: v >= 0, optional=True)
        integer("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None",
                lambda v: 0 <= v <= MAX_LOGPROBS, optional=True)
        integer("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None",
                lambda v: 0 <= v <= MAX_LOGPROBS, optional=True)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be true or false")
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or any(not _is_int(t) or t < 0 for t in ids):
                raise bad("stop_token_ids", "must be a list of non-negative integers")
            self.stop_token_ids = list(ids)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None and (not isinstance(stops, (list, tuple))
                                  or any(not isinstance(s, str) or not s for s in stops)):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_strings = tuple(stops or ())
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not _is_int(t) or t < 0 or not _is_number(v) or not -100 <= v <= 100
                    for t, v in self.logit_bias.items()):
                raise bad("logit_bias", "must map token ids to numbers in [-100, 100]")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise bad("structured_outputs", "must be a StructuredOutputsParams")
            if self.min_tokens or self.ignore_eos:
                raise ParameterError("structured_outputs", "structured_outputs cannot be combined with min_tokens "
                                     "or ignore_eos: the grammar decides where the output may end")
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM: -1 is "no seed"
            self.seed = None

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature below 1e-5 (vLLM's threshold)."""
        return self.temperature < GREEDY_TEMPERATURE
