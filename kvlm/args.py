"""Command-line flags shared by every command that builds an engine (`generate`, `chat`, `serve`,
`cache save`, the benchmarks), and their translation into `EngineConfig` / `SamplingParams`.

Like vLLM's `EngineArgs.add_cli_args`: one definition of each flag, so `kvlm generate --help` and
`kvlm serve --help` never disagree. Values are validated where they land (`EngineConfig`,
`SamplingParams`), once, with a `ParameterError` naming the field.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlm.config import DTYPES, KV_DTYPES, EngineConfig, parse_bytes
from kvlm.errors import ParameterError
from kvlm.sampling_params import SamplingParams


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help, with every option's default shown (like `ArgumentDefaultsHelpFormatter`): a help text
    that says its default itself is kept, an on/off flag gets "(default: off)", any other gets
    "(default: VALUE)" from the parser's own default, so the text cannot drift from the code. A default of
    None must be explained in the help text ("default: cuda when available"); tests/cli checks every flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        optional_positional = not action.option_strings and action.nargs in ("?", "*")
        if (not action.option_strings and not optional_positional) or action.default is argparse.SUPPRESS \
                or "default" in text.lower():
            return action.help
        if action.nargs == 0:  # store_true / store_false
            return f"{text} (default: off)".strip()
        if action.default is None:
            return action.help
        return f"{text} (default: %(default)s)".strip()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: on CPU, GGUF weights computed on in their stored formats (Q4_0/Q4_1/Q8_0 with "
                        "int8-quantized activations on AVX2/AVX-512, the other formats and safetensors with float32 "
                        "ones), on CUDA float32 dense weights; float32/bfloat16/float16: dense weights and "
                        "activations in that dtype (float32 is the exact reference path)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for PyTorch (default: PyTorch's own choice)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length to allow (default: the model's, at most 4096)")
    g.add_argument("--no-kv-cache", action="store_true",
                   help="recompute the whole sequence every step (same tokens, slower)")
    g.add_argument("--kv-cache-layout", default="paged", choices=["paged", "contiguous"],
                   help="paged: blocks from a shared pool (prefix caching, preemption); contiguous: one row of "
                        "--max-model-len slots per sequence")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES,
                   help="K/V element type (auto: the compute dtype, float32; float16 halves KV memory and "
                        "attention reads; int8 / int4: codes with a float16 scale per 32 values, 3.8x / 7.1x "
                        "fewer bytes than float32)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=16, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per engine step (prefill chunk budget)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV pool size: bytes (2GiB, 512MB, or a bare whole number of bytes) or a share of the "
                        "memory available now (30%%); more than 90%% of it is refused (default: --max-num-seqs "
                        "sequences at full context, at most a quarter of available memory and, on CPU, 1 GiB)")
    g.add_argument("--max-kv-tokens", type=int, default=None,
                   help="a bounded KV cache for endless chats and generations: keep at most this many tokens' K/V "
                        "(the first --sink-tokens and the most recent ones; a multiple of --block-size), so a "
                        "request runs past the context with flat memory (default: unbounded, the context ends "
                        "a request)")
    g.add_argument("--sink-tokens", type=int, default=4,
                   help="with --max-kv-tokens: leading 'attention sink' tokens always kept, rounded up to whole "
                        "blocks (StreamingLLM)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse cached K/V blocks of earlier requests with the same beginning")
    g.add_argument("--kv-tier-dir", default=None,
                   help="a disk tier under the prefix cache: blocks evicted from the KV pool are kept as files in "
                        "this directory (shared by processes and restarts) and loaded instead of prefilled again "
                        "(default: no tier; docs/kv_tier.md)")
    g.add_argument("--kv-tier-bytes", default="20GiB", help="with --kv-tier-dir: the tier's size bound (LRU)")
    g.add_argument("--kv-tier-dtype", default=None, choices=["int8"],
                   help="with --kv-tier-dir and a float KV cache: store the tier's blocks as int8 (1.9x to 3.8x "
                        "fewer bytes; lossy: a tier hit is then not bit-identical to recomputing; default: the "
                        "KV cache's own format, lossless)")
    g.add_argument("--kv-tier-write-through", action="store_true",
                   help="with --kv-tier-dir: also store each finished request's prompt blocks at once, not only "
                        "when the pool evicts them")
    g.add_argument("--speculative", default=None, type=speculative_method, metavar="{ngram,suffix,draft:PATH}",
                   help="speculative decoding: ngram (prompt lookup in the request's own text), suffix (an n-gram "
                        "index over it and recent requests) or draft:PATH (a smaller model with the same tokenizer) "
                        "proposes tokens, the model verifies them in one step; the output is the same bits as "
                        "without it (default: off)")
    g.add_argument("--num-speculative-tokens", type=int, default=5,
                   help="with --speculative: tokens proposed per step at most")
    g.add_argument("--no-adaptive-threads", action="store_true",
                   help="always use --threads threads; by default the engine uses fewer while other programs "
                        "keep cores busy (spinning threads slow a shared CPU down many times)")


def speculative_method(value: str) -> str:
    """--speculative: ngram, suffix or draft:PATH (a draft model's file, folder or name)."""
    if value in ("ngram", "suffix") or (value.startswith("draft:") and value[len("draft:"):].strip()):
        return value
    raise argparse.ArgumentTypeError(f"must be ngram, suffix or draft:PATH, got {value!r}")


def speculative_config(method: str | None, k: int) -> dict[str, Any] | None:
    """The `speculative_config` dict of --speculative METHOD and --num-speculative-tokens K (None: off)."""
    if method is None:
        return None
    if method.startswith("draft:"):
        return {"method": "draft", "model": method[len("draft:"):], "num_speculative_tokens": k}
    return {"method": method, "num_speculative_tokens": k}


def engine_kwargs_from_args(a: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig` fields the engine flags set (what `LLM(model, **kwargs)` takes)."""
    mem = None if a.kv_cache_memory is None else parse_bytes(a.kv_cache_memory)
    spec = speculative_config(a.speculative, a.num_speculative_tokens)
    tier_bytes = parse_bytes(a.kv_tier_bytes, "kv_tier_bytes", "--kv-tier-bytes")
    if isinstance(tier_bytes, float):
        raise ParameterError("kv_tier_bytes", f"--kv-tier-bytes: {a.kv_tier_bytes!r}: give bytes (20GiB), not a share")
    return dict(dtype=a.dtype, device=a.device, num_threads=a.threads, max_model_len=a.max_model_len,
                enable_kv_cache=not a.no_kv_cache, kv_cache_layout=a.kv_cache_layout,
                kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size,
                max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory=mem,
                enable_prefix_caching=not a.no_prefix_caching, adaptive_threads=not a.no_adaptive_threads,
                max_kv_tokens=a.max_kv_tokens, sink_tokens=a.sink_tokens, speculative_config=spec,
                kv_tier_dir=a.kv_tier_dir, kv_tier_bytes=tier_bytes, kv_tier_write_through=a.kv_tier_write_through,
                kv_tier_dtype=a.kv_tier_dtype)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_kwargs_from_args(a))


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this probability (1 = all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the top probability (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalize tokens seen in prompt or output, HF semantics (1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract it from every token already output (0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract it x the count of each token already output (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="per-request seed (default: none, unseeded)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None,
                   help="token ids that end generation besides EOS (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--logprobs", type=int, default=None,
                   help="return this many top logprobs per token (with --json; default: none)")


def sampling_params_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                          min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                          seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_ids, ignore_eos=a.ignore_eos,
                          logprobs=a.logprobs)
