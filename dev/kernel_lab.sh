#!/usr/bin/env bash
# The kernel lab: builds variants of the AVX-512 attention microkernels (tile
# sizes MR x NR, pv chunk CW), checks each against the float64 oracle with the
# full SDPA test, and only then times it with `attn bench`.
#   dev/kernel_lab.sh "6 64 4" "12 32 2" ...     (default: a few known shapes)
# Each variant builds in build-lab/MR_NR_CW; the library itself is untouched.
set -euo pipefail
cd "$(dirname "$0")/.."
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=("6 64 4" "8 64 2" "12 32 2" "4 64 4")
for v in "${variants[@]}"; do
  set -- $v
  dir=build-lab/$1_$2_$3
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DATTN_LAB_TILE="-DMR=$1;-DNR=$2;-DCW=$3" >/dev/null
  cmake --build "$dir" -j >/dev/null
  if ! (cd tests && OMP_WAIT_POLICY=passive ATTN_KERNEL=avx512 "../$dir/tests/test_sdpa" 150 >/dev/null); then
    echo "MR=$1 NR=$2 CW=$3: FAILS the oracle check, not timed"
    continue
  fi
  for args in "--heads 8 --dim 64" "--heads 4 --dim 128" "--heads 8 --dim 64 --causal"; do
    printf 'MR=%s NR=%s CW=%s %-28s ' "$1" "$2" "$3" "$args"
    "$dir/attn" bench sdpa --batch 1 --seq 2048 $args --threads 2 --kernel avx512 --json |
      sed -n 's/.*"gflops":\([0-9.]*\).*"fraction_of_peak":\([0-9.]*\).*/\1 GFLOP\/s, \2 of peak/p'
  done
done
