#!/usr/bin/env bash
# Build llama.cpp's shared libraries (and its llama-batched-bench tool) for one x86 ISA, so that
# `kvlm bench compare --llama-lib DIR` can run the peer built for AVX2 on an AVX-512 machine, side by side
# with `KVLM_KERNEL_ISA=avx2` (issue 36), and `bench moe`/`bench throughput` can be set against llama.cpp's
# own batched figure.
#
# The source is the llama.cpp that llama-cpp-python vendors, so the libraries match its Python bindings:
#   pip download --no-deps --no-binary :all: llama-cpp-python==VERSION   (an sdist, ~50 MB)
#   scripts/build_llama_cpp.sh avx2 llama_cpp_python-VERSION.tar.gz OUT_DIR
# ISA: avx2 (AVX2 + FMA + F16C + BMI2, no AVX-512: what most laptops and desktops have), avx2-vnni (the same
# plus AVX-VNNI: Intel client CPUs since Alder Lake, against `KVLM_KERNEL_ISA=avx2-vnni`), avx512
# (AVX-512 F/BW/VL/DQ + VNNI + BF16), or native (-march=native). OUT_DIR gets lib/ (libllama.so and the
# ggml libraries: pass it to --llama-lib, which sets LLAMA_CPP_LIB_PATH for llama-cpp-python) and
# bin/llama-batched-bench. About 10 minutes on 2 cores.
set -euo pipefail
ISA=${1:?usage: build_llama_cpp.sh avx2|avx2-vnni|avx512|native SDIST.tar.gz|SOURCE_DIR OUT_DIR}
SRC=${2:?source}; OUT=${3:?out dir}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
if [ -f "$SRC" ]; then
  tar xzf "$SRC" -C "$OUT"
  SRC=$(ls -d "$OUT"/llama_cpp_python-*/vendor/llama.cpp)
elif [ -d "$SRC/vendor/llama.cpp" ]; then
  SRC=$SRC/vendor/llama.cpp
fi
case $ISA in
  avx2)   FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                 -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
  avx2-vnni) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                 -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=ON) ;;
  avx512) FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                 -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;
  native) FLAGS=(-DGGML_NATIVE=ON) ;;
  *) echo "build_llama_cpp.sh: unknown ISA '$ISA' (avx2, avx2-vnni, avx512, native)" >&2; exit 2 ;;
esac
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON "${FLAGS[@]}" > "$OUT/cmake.log"
cmake --build "$OUT/build" --config Release -j "${JOBS:-$(nproc)}" --target llama llama-batched-bench
mkdir -p "$OUT/lib" "$OUT/bin"
find "$OUT/build" -name '*.so*' \( -name 'libllama*' -o -name 'libggml*' \) -exec cp -P {} "$OUT/lib/" \;
cp "$OUT/build/bin/llama-batched-bench" "$OUT/bin/"
echo "built llama.cpp ($ISA) into $OUT: lib/ for --llama-lib, bin/llama-batched-bench"
