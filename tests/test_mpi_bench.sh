#!/usr/bin/env bash
# attn-mpi-bench runs every strategy (tiny, 2 ranks) and prints one JSON line on rank 0;
# a bad argument exits 2 with one line. Its timings are benchmarks, not checked here.
set -u
BENCH=$1
M=(mpirun -np 2 --oversubscribe --quiet)
fails=0
for s in ring zigzag ulysses auto none link; do
  for extra in "" "--causal --backward"; do
    out=$("${M[@]}" "$BENCH" --seq 96 --heads 4 --kv-heads 2 --dim 16 --repeat 1 --json --strategy $s $extra 2>&1)
    rc=$?
    lines=$(printf '%s\n' "$out" | grep -c '^{')
    if [ $rc -ne 0 ] || [ "$lines" -ne 1 ] || ! printf '%s\n' "$out" | grep -q '"median_s": [0-9]'; then
      echo "FAIL: --strategy $s $extra: rc $rc, $lines JSON lines: $out"
      fails=$((fails + 1))
    fi
  done
done
if printf '%s\n' "$("${M[@]}" "$BENCH" --seq 96 --strategy link --json 2>&1)" | grep -q '"gbytes": [0-9]'; then :; else
  echo "FAIL: link reports no rate"; fails=$((fails + 1))
fi
err=$("${M[@]}" "$BENCH" --strategy bogus 2>&1 >/dev/null)
rc=$?
if [ $rc -eq 0 ] || ! printf '%s\n' "$err" | grep -q "^attn-mpi-bench: --strategy takes"; then
  echo "FAIL: a bad strategy: rc $rc, stderr: $err"; fails=$((fails + 1))
fi
[ $fails -eq 0 ] && echo "attn-mpi-bench: every strategy ran" || exit 1
