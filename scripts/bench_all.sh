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
run throughput_kv16 bench throughput "$MODEL" --threads "$THREADS" --baseline-dtype float32 --no-hf \
    --no-sequential --kv-cache-dtype float16
run prefix      bench prefix "$MODEL" --threads "$THREADS" --plot docs/img/prefix.png

python scripts/make_benchmarks_md.py
echo "wrote docs/benchmarks.md" >&2
