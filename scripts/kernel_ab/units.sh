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
