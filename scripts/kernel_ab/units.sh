# Sourced by run.sh and rows.sh: write_units OLD_CSRC NEW_CSRC ISA DIR writes DIR/old.cpp and DIR/new.cpp,
# each one tree's kernels_impl.h under the head of kvlm/kernels/csrc/isa_<ISA>.cpp (its target pragma and
# ISA defines), as kvlm_old / kvlm_new.
write_units() {
  local unit head side dir
  unit="$2/isa_$(echo "$3" | tr - _).cpp"
  [ -f "$unit" ] || { echo "kernel_ab: no unit $unit" >&2; exit 2; }
  head=$(grep -E '^#(pragma GCC target|define KVLM_(AVX|VNNI))' "$unit")
  for side in old new; do
    dir=$([ $side = old ] && echo "$1" || echo "$2")
    printf '%s\n#define KVLM_ISA_FN kvlm_%s\n#include "%s/kernels_impl.h"\n' "$head" "$side" "$dir" > "$4/$side.cpp"
  done
}
FL="-O3 -std=c++20 -fopenmp -Wno-psabi -fno-math-errno"

# build_objects OLD_REV|OLD_TREE ROOT ISA DIR: DIR/old.o and DIR/new.o, OLD's and ROOT's kernels (a tree
# folder, or a revision of ROOT's git). KVLM_AB_CACHE=dir: keep both objects there (old-ISA.o, new-ISA.o)
# and reuse them: repeated runs of one pair of trees (a measurement script) compile once. Delete the folder
# when either tree changes.
build_objects() {
  local olddir side c=${KVLM_AB_CACHE:-}
  if [ -d "$1/kvlm/kernels/csrc" ]; then olddir=$(cd "$1" && pwd)/kvlm/kernels/csrc
  else git -C "$2" archive "$1" kvlm/kernels/csrc | tar -x -C "$4"; olddir=$4/kvlm/kernels/csrc; fi
  # an A/B of identical sources (OLD = HEAD after committing the change) measures nothing: say so (unless
  # KVLM_AB_PAGES=huge, where the two sides differ in the weights' page size, gbs.cpp)
  if [ -z "${KVLM_AB_PAGES:-}" ] && diff -rq "$olddir" "$2/kvlm/kernels/csrc" >/dev/null; then
    echo "kernel_ab: $1 has this tree's kernel sources: nothing to compare (name the revision before the change)" >&2
    exit 2
  fi
  write_units "$olddir" "$2/kvlm/kernels/csrc" "$3" "$4"
  for side in old new; do
    if [ -n "$c" ] && [ -f "$c/$side-$3.o" ]; then cp "$c/$side-$3.o" "$4/$side.o"
    else g++ $FL -c "$4/$side.cpp" -o "$4/$side.o" & fi
  done
  wait
  if [ -n "$c" ]; then mkdir -p "$c"; for side in old new; do cp -n "$4/$side.o" "$c/$side-$3.o"; done; fi
}
