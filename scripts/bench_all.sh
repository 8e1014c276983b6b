#!/usr/bin/env bash
# Run every benchmark on the default model with 2 threads and write docs/benchmarks.md from the outputs.
#
# Each command's stdout (its table, then one JSON line) goes to docs/results/<name>.txt after a first
# line "$ <command>"; its stderr (progress, load logs) to docs/results/<name>.stderr.txt. Plots go to
# docs/img/. Run it on a quiet machine: the timings are only as good as the machine's idleness.
# Usage: scripts/bench_all.sh            (MODEL and THREADS may be overridden from the environment)
set -euo pipefail

cd "$(dirname "$0")/.."
MODEL="${MODEL:-smollm2-135m}"
THREADS="${THREADS:-2}"
mkdir -p docs/results docs/img

run() {  # run NAME ARGS...: record the command line, then its output
    local name="$1"
    shift
    echo "== $name: kvlm $*" >&2
    {
        echo "\$ kvlm $*"
        kvlm "$@" 2>"docs/results/$name.stderr.txt"
    } >"docs/results/$name.txt"
}

run decode      bench decode "$MODEL" --threads "$THREADS"
run throughput  bench throughput "$MODEL" --threads "$THREADS" --baseline-dtype float32
run waste       bench waste "$MODEL" --threads "$THREADS" --plot docs/img/waste.png
run invariance  bench invariance "$MODEL" --threads "$THREADS" --plot docs/img/invariance.png
run latency     bench latency "$MODEL" --threads "$THREADS" --plot docs/img/roofline.png
run kv_size     kv-size "$MODEL" --dtype float16 --compare-known --plot docs/img/kv_size.png
# LLAMA_PYTHON: an interpreter with llama-cpp-python, when it lives in another environment.
run compare     bench compare "$MODEL" --threads "$THREADS" --plot docs/img/compare_context.png \
    ${LLAMA_PYTHON:+--llama-python "$LLAMA_PYTHON"}
run compare_kv16 bench compare "$MODEL" --threads "$THREADS" --kv-cache-dtype float16 \
    ${LLAMA_PYTHON:+--llama-python "$LLAMA_PYTHON"}
# The default model in the formats people download (scripts/make_quant_fixtures.py: requantized by
# llama.cpp's own quantizer from a float32 export), side by side with llama.cpp in one run; the recorded
# output names the files under $KVLM_HOME, not this machine's home.
if [ -n "${LLAMA_PYTHON:-}" ]; then
    python scripts/make_quant_fixtures.py --llama-python "$LLAMA_PYTHON" >&2
    KH="${KVLM_HOME:-$HOME/.cache/kvlm}"
    FIX="$KH/fixtures/SmolLM2-135M-Instruct"
    run compare_formats bench compare --gguf "$KH/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" \
        "$FIX.Q4_K_M.gguf" "$FIX.Q5_K_M.gguf" "$FIX.Q6_K.gguf" "$FIX.Q8_0.gguf" --threads "$THREADS" \
        --contexts 2048 --repeats 2 --no-reference --no-whole-process --llama-python "$LLAMA_PYTHON"
    sed -i "s|$KH|\$KVLM_HOME|g" docs/results/compare_formats.txt docs/results/compare_formats.stderr.txt
    # Gemma 3 270M (the second architecture; Q8_0/Q5_0/Q4_K/Q6_K tensors) against llama.cpp on its PyPI file.
    run compare_gemma3 bench compare gemma3-270m --threads "$THREADS" --contexts 2048 --repeats 2 \
        --no-reference --no-whole-process --llama-python "$LLAMA_PYTHON"
fi
run throughput_kv16 bench throughput "$MODEL" --threads "$THREADS" --baseline-dtype float32 --no-hf \
    --no-sequential --kv-cache-dtype float16
run prefix      bench prefix "$MODEL" --threads "$THREADS" --plot docs/img/prefix.png

python scripts/make_benchmarks_md.py
echo "wrote docs/benchmarks.md" >&2
