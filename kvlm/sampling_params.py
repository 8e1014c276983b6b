"""`SamplingParams`: how one request picks its tokens and when it stops (vLLM semantics).

Validated on construction: an invalid value raises `ValueError` naming the parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping options.

    temperature: 0 means greedy (argmax). top_k: 0 or -1 disables. top_p in (0, 1]. min_p in [0, 1]: drop
    tokens whose probability is below min_p x the top probability. repetition_penalty (HF semantics, over
    prompt and output): positive logits are divided by it, negative ones multiplied. presence_penalty and
    frequency_penalty (OpenAI semantics, over output tokens): subtract p * [count > 0] and f * count.
    seed: a per-request generator, so the same seed gives the same tokens whatever else is batched.
    stop: strings that end generation; they are excluded from the text and never streamed in part.
    logprobs: how many top alternatives to return per generated token (None: none).
    prompt_logprobs: the same for each prompt token (the first has none); such a request computes its
    whole prompt (it takes no cached prefix), as in vLLM.
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
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        if self.n != 1:
            raise bad("n", "must be 1 (several completions per prompt are not supported yet)")
        if not self.temperature >= 0:  # also rejects NaN
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1, 0 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be a positive integer or None")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                  or not 0 <= self.prompt_logprobs <= 20):
            raise bad("prompt_logprobs", "must be in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.stop_token_ids is not None and any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "must be non-empty strings")
        self.stop_strings = tuple(stops)
        if self.logit_bias is not None and any(not isinstance(t, int) or t < 0 or not -100 <= b <= 100
                                               for t, b in self.logit_bias.items()):
            raise bad("logit_bias", "must map token ids to values in [-100, 100]")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
