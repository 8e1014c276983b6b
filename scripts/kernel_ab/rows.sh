#!/usr/bin/env bash
# Int8 kernel A/B per number of rows of x: OLD_REV's (or an old tree's) gemv_i8 against this tree's, in one
# process, every M of the list timed alternately (median of ROUNDS, default 3).
#   [KVLM_AB_ISA=avx2|avx512|avx512-vnni] [ROUNDS=3] scripts/kernel_ab/rows.sh OLD_REV|OLD_TREE FMT N K THREADS HOT M...
# e.g. rows.sh main Q4_1 1536 576 1 0 1 2 4 6 8 16  (Q4_1 1536x576, 1 thread, cold weights).
# Prints per M: old and new ms, each M's cost over M = 1's, and new/old speed. Exits 1 if a row's bits
# differ between M and M = 1 or between the trees.
set -euo pipefail
if [ $# -lt 7 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then sed -n 2,7p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
OLD=$1; shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
. "$(dirname "$0")/units.sh"
build_objects "$OLD" "$ROOT" "${KVLM_AB_ISA:-avx512-vnni}" "$W"  # KVLM_AB_CACHE=dir: see units.sh
g++ $FL -mf16c -I"$ROOT/kvlm/kernels/csrc" "$(dirname "$0")/rows.cpp" "$W/old.o" "$W/new.o" -o "$W/rows"
FMT=$1 N=$2 K=$3 TH=$4 HOT=$5; shift 5
"$W/rows" "$FMT" "$N" "$K" "$TH" "$HOT" "${ROUNDS:-3}" "$@" | python3 -c "
import statistics as st, sys
t = {}
for line in sys.stdin:
    f = line.split()
    if f[0] == 'MISMATCH': print(line.strip()); sys.exit(1)
    t.setdefault((f[0], int(f[4])), []).append(float(f[-1]))
ms = sorted({m for _, m in t})
med = {k: st.median(v) for k, v in t.items()}
o1, n1 = med[('old', ms[0])], med[('new', ms[0])]
print(f'$FMT ${N}x$K threads=$TH hot=$HOT (${KVLM_AB_ISA:-avx512-vnni}); ms per call, and per M={ms[0]} call')
for m in ms:
    o, n = med[('old', m)], med[('new', m)]
    print(f'  M={m:2d}: old {o:8.3f} ({o / o1:5.2f}x)  new {n:8.3f} ({n / n1:5.2f}x)  new/old speed {o / n:.2f}x', flush=True)
"
