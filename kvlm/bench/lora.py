"""`kvlm bench lora`: what serving a LoRA adapter costs: its load time, and decode at batch 1 with the adapter
against the base, side by side in one run.

The adapter is `--lora NAME=PATH[:SCALE]` (a PEFT folder or a GGUF LoRA file), or, by default, a random one
this command writes as a PEFT folder (rank `--rank` on `--target-modules`, every projection by default,
seeded): load time and decode cost depend on its size, not its values. One engine serves both: greedy requests
of `--max-tokens` tokens on the same chat prompt alternate base, adapter, base, ... (`--repeats` each, median
decode tok/s, first token to last), so a shared machine's changing load hits them alike; the prefix cache is
off so each run prefills alike. Decode-only steps run the fused native step with and without the adapter
(docs/lora.md).

llama.cpp, beside it (on a GGUF base, when llama-cpp-python is importable by `--llama-python`): the same
adapter written as a GGUF LoRA file (convert_lora_to_gguf's layout: Q/K rows of B permuted as the base's),
decode at batch 1 without and with it, alternating, in a child process (`llama_cpp_worker.py lora`). An
adapter costs its bytes on both: decode at batch 1 reads every weight once per token, and a rank-16 float32
adapter on every projection of SmolLM2-135M is ~20% of the base's bytes. The last line is the JSON document.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlm.bench.common import DEFAULT_MODEL, Bench, add_model_args, log, run_header, standalone
from kvlm.bench.compare import WORKER, default_llama_python, llama_env
from kvlm.lora import parse_lora_spec

PROMPT = "Tell me a short story about a fox who learns to play the violin."


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# HF module -> llama.cpp's tensor name in a layer (convert_lora_to_gguf names adapter tensors after the base's)
_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def random_adapter(config: Any, rank: int, seed: int = 0, dtype: str = "float32",
                   targets: tuple[str, ...] = ALL_TARGETS) -> dict[tuple[int, str], tuple[Any, Any]]:
    """{(layer, module): (A (rank x in), B (out x rank))}, seeded, in `dtype` ("float32" or "bfloat16")."""
    import torch

    from kvlm.lora.adapter import module_shapes

    g = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype)
    shapes = module_shapes(config)
    return {(layer, m): ((torch.randn(rank, shapes[m][1], generator=g) / shapes[m][1] ** 0.5).to(kind),
                         (torch.randn(shapes[m][0], rank, generator=g) * 0.01).to(kind))
            for layer in range(config.num_hidden_layers) for m in targets}


def write_random_adapter(folder: Path, config: Any, rank: int, seed: int = 0, dtype: str = "float32",
                         targets: tuple[str, ...] = ALL_TARGETS) -> Path:
    """A PEFT folder with a random rank-`rank` adapter on `targets` of the base `config`, its tensors saved in
    `dtype` ("float32" or "bfloat16", as adapters trained in bfloat16 are saved)."""
    from safetensors.torch import save_file

    tensors = {}
    for (layer, module), (a, b) in random_adapter(config, rank, seed, dtype, targets).items():
        block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        pre = f"base_model.model.model.layers.{layer}.{block}.{module}"
        tensors[f"{pre}.lora_A.weight"], tensors[f"{pre}.lora_B.weight"] = a, b
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}))
    return folder


def write_random_gguf_lora(path: Path, base: Path, config: Any, rank: int, seed: int = 0, dtype: str = "float32",
                           targets: tuple[str, ...] = ALL_TARGETS) -> Path:
    """The adapter `write_random_adapter` writes with the same arguments, as llama.cpp's GGUF LoRA for the GGUF
    `base` (F32 or BF16 tensors; alpha = 2 rank, so both apply it at scale 2)."""
    import gguf
    import numpy as np
    import torch

    from kvlm.loader.gguf import PERMUTED_QK, permute_rope, read_gguf

    arch = str(read_gguf(base)[1].get("general.architecture"))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 2.0 * rank)
    for (layer, module), (a, b) in random_adapter(config, rank, seed, dtype, targets).items():
        if arch in PERMUTED_QK and module in ("q_proj", "k_proj"):
            b = permute_rope(b, config.num_attention_heads if module == "q_proj" else config.num_key_value_heads)
        for ab, t in (("a", a), ("b", b)):
            name = f"blk.{layer}.{_GGUF_NAMES[module]}.weight.lora_{ab}"
            if t.dtype == torch.bfloat16:
                w.add_tensor(name, t.contiguous().view(torch.int16).numpy().view(np.uint16),
                             raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(name, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama_cpp_lora(python: str, base: Path, lora: Path, spec: dict[str, Any], lib: str | None) -> dict[str, Any]:
    """llama.cpp's decode tok/s runs without and with the GGUF LoRA `lora` (llama_cpp_worker.py lora)."""
    p = subprocess.run([python, str(WORKER), "lora", str(base), str(lora)], input=json.dumps(spec),
                       capture_output=True, text=True, timeout=1800, check=False, env=llama_env(lib))
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1])
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(model: str = DEFAULT_MODEL, threads: int = 2, lora: str | None = None, rank: int = 16,
        max_tokens: int = 128, repeats: int = 5, loads: int = 3, adapter_dtype: str = "float32",
        targets: tuple[str, ...] = ALL_TARGETS, llama_cpp: bool = True, llama_python: str | None = None,
        llama_lib: str | None = None) -> dict[str, Any]:
    from statistics import median

    from kvlm import LLM, SamplingParams
    from kvlm.loader import resolve_model

    doc = run_header("lora", model, threads)
    llm = LLM(model, num_threads=threads, enable_prefix_caching=False, adaptive_threads=False)
    eng = llm.llm_engine
    base = resolve_model(model, quiet=True)
    llama_python = llama_python or default_llama_python()
    peer = {"name": "llama.cpp (llama-cpp-python)"}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = llm.render_chat([{"role": "user", "content": PROMPT}])
    with tempfile.TemporaryDirectory() as tmp:
        if lora is None:
            name, path, scale = "random", str(write_random_adapter(Path(tmp) / "adapter", eng.model_config, rank,
                                                                dtype=adapter_dtype, targets=targets)), 1.0
        else:
            name, path, scale = parse_lora_spec(lora)
        load_s = []
        for i in range(loads):  # the first load reads the file from disk, later ones from the page cache
            t0 = time.perf_counter()
            eng.load_lora(f"{name}-{i}", path, scale)
            load_s.append(time.perf_counter() - t0)
        if not llama_cpp:
            peer["skipped"] = "disabled by flag"
        elif llama_python is None:
            peer["skipped"] = "not installed (pip install llama-cpp-python, or pass --llama-python)"
        elif base.suffix != ".gguf":
            peer["skipped"] = f"{base.name} is not a GGUF file"
        elif lora is not None and Path(path).suffix != ".gguf":
            peer["skipped"] = "the adapter is not a GGUF LoRA file (llama.cpp reads only those)"
        else:
            gguf_lora = Path(path) if lora is not None else write_random_gguf_lora(
                Path(tmp) / "adapter.gguf", base, eng.model_config, rank, dtype=adapter_dtype, targets=targets)
            spec = {"threads": threads, "n_ctx": len(ids) + max_tokens + 8, "decode_ids": ids,
                    "gen_tokens": max_tokens, "repeats": repeats}
            log("llama.cpp: base and adapter, interleaved")
            try:
                out = _llama_cpp_lora(llama_python, base, gguf_lora, spec, llama_lib)
                b, a = median(out["runs"]["base"]), median(out["runs"]["lora"])
                peer.update(version=out["version"], base_tokens_per_s=b, lora_tokens_per_s=a,
                            ratio=a / b if b else None, runs=out["runs"])
            except (OSError, RuntimeError, subprocess.SubprocessError, json.JSONDecodeError) as e:
                peer["skipped"] = f"{type(e).__name__}: {e}"
    adapter = eng.loras.get(f"{name}-0")
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up
    rates: dict[str, list[float]] = {"base": [], "lora": []}
    for _ in range(repeats):  # base, lora, base, ...
        for which in ("base", "lora"):
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                               lora=None if which == "base" else adapter.name)
            rates[which].append(out[0].metrics.decode_tokens_per_s or 0.0)
            log(f"{which:5s} {rates[which][-1]:.1f} tok/s")
    b, with_lora = median(rates["base"]), median(rates["lora"])
    what = "all projections" if tuple(targets) == ALL_TARGETS else ", ".join(targets)
    doc.update(adapter=path if lora else f"random rank {rank}, {what}, {adapter_dtype}", rank=adapter.rank,
               targets=list(adapter.targets), adapter_bytes=adapter_bytes(adapter), load_s=load_s, batch=1,
               max_tokens=max_tokens, repeats=repeats, base_decode_path=eng.backend.decode, base_tokens_per_s=b,
               lora_tokens_per_s=with_lora, ratio=with_lora / b if b else None, runs=rates, llama_cpp=peer)
    return doc


def adapter_bytes(adapter: Any) -> int:
    """Bytes of the adapter's tensors as kvlm holds them (A rows and packed B): what a decode step reads beside
    the base."""
    return sum(w.a.nbytes + w.bt.numel() * w.bt.element_size() for w in adapter.weights.values())


def print_table(d: dict[str, Any]) -> None:
    print(f"adapter: {d['adapter']} (rank {d['rank']}, {d['adapter_bytes'] / 2**20:.1f} MiB); load "
          f"{', '.join(f'{s * 1e3:.0f} ms' for s in d['load_s'])}")
    print(f"batch 1, greedy, {d['max_tokens']} tokens, {d['threads']} threads, {d['cpu']}, median of "
          f"{d['repeats']} interleaved runs")
    print(f"kvlm: base ({d['base_decode_path']} decode) {d['base_tokens_per_s']:.1f} tok/s   with the adapter "
          f"{d['lora_tokens_per_s']:.1f} tok/s   ratio {d['ratio']:.2f}x")
    p = d["llama_cpp"]
    if "skipped" in p:
        print(f"{p['name']}: skipped: {p['skipped']}")
    else:
        print(f"{p['name']} {p['version']}: base {p['base_tokens_per_s']:.1f} tok/s   with the adapter "
              f"{p['lora_tokens_per_s']:.1f} tok/s   ratio {p['ratio']:.2f}x")


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--lora", metavar="NAME=PATH[:SCALE]", default=None,
                   help="the adapter to measure (default: a random PEFT adapter written to a temporary folder)")
    p.add_argument("--rank", type=int, default=16, help="rank of the random adapter")
    p.add_argument("--target-modules", default=",".join(ALL_TARGETS), metavar="M,M,...",
                   help="the random adapter's projections (PEFT's default for Llama models is q_proj,v_proj)")
    p.add_argument("--adapter-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the random adapter's tensor type (a bfloat16 one is kept in bfloat16: half the bytes a "
                        "decode step reads)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="runs with and without the adapter, interleaved (median)")
    p.add_argument("--llama-python", default=None,
                   help="interpreter with llama-cpp-python installed (default: this one, if it has it)")
    p.add_argument("--llama-lib", metavar="DIR", default=None,
                   help="llama.cpp libraries to load instead of llama-cpp-python's own")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")


def run_args(a: argparse.Namespace) -> dict[str, Any]:
    targets = tuple(t.strip() for t in a.target_modules.split(",") if t.strip())
    bad = [t for t in targets if t not in ALL_TARGETS]
    if bad or not targets:
        raise ValueError(f"--target-modules: {', '.join(bad) or 'none given'}: choose among {', '.join(ALL_TARGETS)}")
    if a.llama_python is not None and not Path(a.llama_python).exists():
        raise ValueError(f"--llama-python: no such file {a.llama_python}")
    if a.llama_lib is not None and not (Path(a.llama_lib) / "libllama.so").exists():
        raise ValueError(f"--llama-lib: no libllama.so in {a.llama_lib}")
    return run(a.model, threads=a.threads, lora=a.lora, rank=a.rank, max_tokens=a.max_tokens, repeats=a.repeats,
               adapter_dtype=a.adapter_dtype, targets=targets, llama_cpp=not a.no_llama_cpp,
               llama_python=a.llama_python, llama_lib=a.llama_lib)


BENCH = Bench("lora", "a LoRA adapter's load time, and decode at batch 1 with it vs the base, side by side",
              add_args, run_args, print_table)

if __name__ == "__main__":
    standalone(BENCH)
