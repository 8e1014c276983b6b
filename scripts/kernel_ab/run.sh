#!/usr/bin/env bash
# Kernel A/B of the int8 kernels: OLD_REV's against this tree's, interleaved in one process.
#   [KVLM_AB_ISA=avx2|avx512|avx512-vnni] scripts/kernel_ab/run.sh OLD_REV [FMT N K M THREADS HOT ...]
# Without cases it runs docs/kernels.md's table (1B and SmolLM2 shapes, M = 1 cold and M = 64 hot).
# Needs g++ with OpenMP and a CPU with the ISA (default avx2). Prints, per case, old and new ms (median of 3)
# and new/old speed.
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then sed -n 2,5p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
OLD=$1; shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
git -C "$ROOT" archive "$OLD" kvlm/kernels/csrc | tar -x -C "$W"
. "$(dirname "$0")/units.sh"
write_units "$W/kvlm/kernels/csrc" "$ROOT/kvlm/kernels/csrc" "${KVLM_AB_ISA:-avx2}" "$W"
g++ $FL -c "$W/old.cpp" -o "$W/old.o" & g++ $FL -c "$W/new.cpp" -o "$W/new.o"; wait
g++ $FL -mf16c -I"$ROOT/kvlm/kernels/csrc" "$(dirname "$0")/ab.cpp" "$W/old.o" "$W/new.o" -o "$W/ab"
if [ $# -eq 0 ]; then
  set -- Q4_0 8192 2048 1 1 0  Q4_0 2048 8192 1 1 0  Q4_K 8192 2048 1 1 0  Q4_K 2048 8192 1 1 0 \
         Q6_K 2048 8192 1 1 0  Q6_K 49152 2048 1 1 0  Q4_0 8192 2048 1 2 0  Q4_K 8192 2048 1 2 0 \
         Q4_0 2048 2048 64 1 1  Q4_K 2048 2048 64 1 1  Q6_K 2048 2048 64 1 1  Q4_0 8192 2048 64 1 1 \
         Q4_1 1536 576 1 1 0  Q4_1 576 1536 1 1 0  Q8_0 49152 576 1 1 0  Q4_1 1536 576 64 1 1  Q8_0 49152 576 64 1 1
fi
while [ $# -ge 6 ]; do
  "$W/ab" "$1" "$2" "$3" "$4" "$5" "$6" | python3 -c "
import statistics as st, sys
t = {}
for line in sys.stdin:
    f = line.split(); t.setdefault(f[0], []).append(float(f[-4]))
o, n = st.median(t['old']), st.median(t['new'])
print(f'$1 ${2}x$3 M=$4 threads=$5 hot=$6: old {o:.3f} ms, new {n:.3f} ms, new/old speed {o / n:.2f}x', flush=True)"
  shift 6
done
