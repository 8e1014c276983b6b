#!/usr/bin/env bash
# Decode kernel A/B in GB/s of weight bytes: OLD_REV's (or an old tree's) int8 gemv_i8 against this tree's,
# in one process, alternating (median of ROUNDS rounds of 0.3 s each), with the machine's read and copy
# bandwidth at the same thread count.
#   [KVLM_AB_ISA=avx2|avx512|avx512-vnni] [ROUNDS=5] [THREADS=2] [HOT=0] scripts/kernel_ab/gbs.sh OLD_REV|OLD_TREE [FMT N K M ...]
# Without cases: every int8 format at M = 1 on a 1B's shapes (2048x2048, 8192x2048, 2048x8192, 49152x2048).
# Prints per case old and new GB/s (wall; per core of process CPU time, median and best: on a loaded machine
# the best CPU-time round is the least disturbed one) and new/old. Exits 1 if the
# trees' outputs differ in any bit. KVLM_AB_CACHE=dir keeps the two compiled objects for reruns.
# KVLM_AB_PAGES=huge: the new side reads its weights from 2 MiB pages (OLD may then be this tree: pages alone).
set -euo pipefail
if [ $# -lt 1 ] || [ "$1" = "--help" ] || [ "$1" = "-h" ]; then sed -n 2,9p "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
OLD=$1; shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
. "$(dirname "$0")/units.sh"
build_objects "$OLD" "$ROOT" "${KVLM_AB_ISA:-avx2}" "$W"
g++ $FL -mf16c -I"$ROOT/kvlm/kernels/csrc" "$(dirname "$0")/gbs.cpp" "$W/old.o" "$W/new.o" -o "$W/gbs"
if [ $# -eq 0 ]; then
  for f in Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K; do
    set -- "$@" $f 2048 2048 1 $f 8192 2048 1 $f 2048 8192 1 $f 49152 2048 1
  done
fi
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} "$W/gbs" "${ROUNDS:-5}" "${THREADS:-2}" "${HOT:-0}" "$@" | python3 -c "
import statistics as st, sys
t, order = {}, []
for line in sys.stdin:
    f = line.split()
    if f[0] in ('MISMATCH', 'bandwidth'): print(line.strip(), flush=True)
    if f[0] == 'MISMATCH': sys.exit(1)
    if f[0] not in ('old', 'new'): continue
    case = ' '.join(f[1:5])
    if case not in t: order.append(case)
    t.setdefault(case, {}).setdefault(f[0], []).append((float(f[-4]), float(f[-2])))
    if len(t[case].get('old', [])) == len(t[case].get('new', [])) == ${ROUNDS:-5}:
        o, n = t[case]['old'], t[case]['new']
        og, ng = st.median(g for g, _ in o), st.median(g for g, _ in n)
        oc, nc = st.median(c for _, c in o), st.median(c for _, c in n)
        ob, nb = max(c for _, c in o), max(c for _, c in n)
        print(f'{case:30s} old {og:6.2f} GB/s ({oc:5.2f}/core, best {ob:5.2f})  new {ng:6.2f} GB/s ({nc:5.2f}/core, best {nb:5.2f})'
              f'  new/old {ng / og:.2f}x (per core {nc / oc:.2f}x, best {nb / ob:.2f}x)', flush=True)
"
