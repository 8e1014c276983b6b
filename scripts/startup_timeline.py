"""Where a fresh `kvlm generate` process spends its time and memory, phase by phase.

    python scripts/startup_timeline.py [kvlm generate arguments...]

Runs `kvlm generate` in this process (t = 0 when the interpreter is up, ~20 ms after exec) (default: the
`kvlm bench compare` whole-process command, a chat prompt and 128 greedy tokens on the default model, 2
threads) with the functions of each start-up phase wrapped, and prints, after each phase: seconds since
start, the phase's seconds, RSS and peak RSS (VmHWM). Then the resident memory by mapping (heap, anonymous,
the mapped GGUF file, libtorch_cpu, other shared libraries) after `import torch`, after load, after the
first step and at the end, and whether torch._dynamo, jinja2 or transformers were imported. A measuring
tool: it patches kvlm functions in its own process.
"""

from __future__ import annotations

import os
import sys
import time

T0 = [time.perf_counter()]  # reset once the command line is known
marks: list[tuple[str, float, int, int]] = []
maps: list[tuple[str, dict[str, int]]] = []


def _status() -> tuple[int, int]:
    cur = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) // 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) // 1024
    return cur, hwm


def mark(label: str) -> None:
    marks.append((label, time.perf_counter() - T0[0], *_status()))


def mapping_rss(label: str) -> None:
    """Resident MiB by kind of mapping, from /proc/self/smaps."""
    groups: dict[str, int] = {}
    name = "?"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                path = parts[5] if len(parts) > 5 else "[anon]"
                name = ("gguf (mapped)" if path.endswith(".gguf") else "libtorch_cpu.so" if "libtorch_cpu" in path
                        else "other .so" if ".so" in path else path if path.startswith("[") else "other files")
            elif parts[0] == "Rss:":
                groups[name] = groups.get(name, 0) + int(parts[1])
    maps.append((label, {k: v // 1024 for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v >= 1024}))


def wrap(owner: object, name: str, label: str, after: object = None) -> None:
    f = getattr(owner, name)

    def g(*a: object, **k: object) -> object:
        out = f(*a, **k)
        mark(label)
        if after is not None:
            after(label)  # type: ignore[operator]
        return out

    setattr(owner, name, g)


def _default_model_and_chat() -> list[str]:
    """The default model's path and `kvlm bench compare`'s chat prompt rendered by its template, from a
    child process (so this one has not imported anything for them)."""
    import json
    import subprocess

    code = ("import json; from kvlm.bench.compare import CHAT; from kvlm.llm import LLM; "
            "llm = LLM('smollm2-135m'); "
            "print(json.dumps([str(llm.llm_engine.model_path), llm.tokenizer.apply_chat_template(CHAT)]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    if not argv:
        argv = ["-q", "generate", *_default_model_and_chat(), "--max-tokens", "128", "--ignore-eos",
                "--threads", "2", "--dtype", "auto"]
    T0[0] = time.perf_counter()
    mark("interpreter up")
    import kvlm.cli.main

    mark("import kvlm.cli.main")
    import torch  # noqa: F401

    mark("import torch")
    mapping_rss("after import torch")
    import kvlm.engine.engine
    import kvlm.loader.gguf
    import kvlm.tokenizer.cache
    from kvlm.kernels import native
    from kvlm.model.llama import LlamaForCausalLM

    mark("import kvlm.engine.engine (model, loader, kernels)")
    wrap(kvlm.loader.gguf, "load_gguf", "GGUF parse + map, QuantTensor views")
    wrap(kvlm.tokenizer.cache, "gguf_tokenizer", "tokenizer (cached next to the model)")
    wrap(LlamaForCausalLM, "__init__", "model built on the meta device")
    wrap(native, "_build_and_load", "native extension loaded")
    wrap(LlamaForCausalLM, "load_weights", "load_weights (stack q/k/v, gate/up)")
    wrap(kvlm.engine.engine, "make_kv_cache", "to(), KV pool")
    wrap(kvlm.engine.engine.Engine, "__init__", "engine ready (heap trimmed, unused pages dropped)", mapping_rss)
    steps = [0]
    step = kvlm.engine.engine.Engine.step

    def counted(self: object) -> object:
        out = step(self)
        steps[0] += 1
        if steps[0] == 1:
            mark("first step (prefill)")
            mapping_rss("after the first step")
        return out

    kvlm.engine.engine.Engine.step = counted  # type: ignore[method-assign]
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115
    try:
        kvlm.cli.main.main(argv)
    finally:
        sys.stdout = stdout
    mark(f"decode done ({steps[0]} steps)")
    mapping_rss("end")
    prev = 0.0
    print(f"{'phase':52s} {'t (s)':>7s} {'dt':>6s} {'RSS MiB':>8s} {'peak':>6s}")
    for label, t, cur, hwm in marks:
        print(f"{label:52s} {t:7.3f} {t - prev:6.3f} {cur:8d} {hwm:6d}")
        prev = t
    for label, groups in maps:
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in groups.items()) + " (MiB)")
    print("imported: " + ", ".join(f"{m} {m in sys.modules}" for m in ("torch._dynamo", "jinja2", "transformers")))


if __name__ == "__main__":
    main(sys.argv[1:])
