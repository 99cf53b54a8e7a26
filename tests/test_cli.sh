#!/usr/bin/env bash
# The attn tool's contract: the documented flags work and agree with the PyTorch
# goldens; every bad input exits 1 or 2 with one line on stderr and no output file.
# usage: test_cli.sh ATTN NPY_COMPARE TMPDIR   (run from tests/)
set -u
ATTN=$1 CMP=$2 T=$3
rm -rf "$T" && mkdir -p "$T"
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }

# expect CODE OUTFILE -- ARGS: exit status CODE; on failure one stderr line and no OUTFILE
expect() {
  local code=$1 out=$2; shift 3
  "$ATTN" "$@" >"$T/stdout" 2>"$T/stderr"
  local rc=$?
  if [ "$rc" != "$code" ]; then bad "attn $* exited $rc, want $code: $(cat "$T/stderr")"; return; fi
  if [ "$code" != 0 ]; then
    local lines; lines=$(wc -l <"$T/stderr")
    if [ "$lines" != 1 ] || ! grep -q '^attn: ' "$T/stderr"; then bad "attn $*: want one 'attn: ' line on stderr, got: $(cat "$T/stderr")"; return; fi
    if [ -n "$out" ] && [ -e "$out" ]; then bad "attn $*: left $out behind"; return; fi
    if ls "$T" | grep -q '\.tmp'; then bad "attn $*: left a temporary file"; return; fi
  fi
  ok
}
close() { # close A B TOL
  if "$CMP" "$1" "$2" "$3" >/dev/null; then ok; else bad "$1 differs from $2"; fi
}

G=golden
# --- sdpa on the goldens ---
expect 0 "" -- sdpa --q $G/sdpa_plain/q.npy --k $G/sdpa_plain/k.npy --v $G/sdpa_plain/v.npy --out "$T/o.npy" --weights-out "$T/w.npy" --threads 2
close "$T/o.npy" $G/sdpa_plain/out.npy 1e-5
close "$T/w.npy" $G/sdpa_plain/weights.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_causal_tl/q.npy --k $G/sdpa_causal_tl/k.npy --v $G/sdpa_causal_tl/v.npy --out "$T/o.npy" --causal
close "$T/o.npy" $G/sdpa_causal_tl/out.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_causal_br/q.npy --k $G/sdpa_causal_br/k.npy --v $G/sdpa_causal_br/v.npy --out "$T/o.npy" --causal=bottom-right
close "$T/o.npy" $G/sdpa_causal_br/out.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_keep_4d/q.npy --k $G/sdpa_keep_4d/k.npy --v $G/sdpa_keep_4d/v.npy --mask $G/sdpa_keep_4d/mask.npy --out "$T/o.npy"
close "$T/o.npy" $G/sdpa_keep_4d/out.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_additive/q.npy --k $G/sdpa_additive/k.npy --v $G/sdpa_additive/v.npy --mask $G/sdpa_additive/mask.npy --out "$T/o.npy"
close "$T/o.npy" $G/sdpa_additive/out.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_seed_mask/q.npy --k $G/sdpa_seed_mask/k.npy --v $G/sdpa_seed_mask/v.npy --mask $G/sdpa_seed_mask/mask.npy --mask-mode seed --out "$T/o.npy"
close "$T/o.npy" $G/sdpa_seed_mask/out.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_gqa/q.npy --k $G/sdpa_gqa/k.npy --v $G/sdpa_gqa/v.npy --out "$T/o.npy"
close "$T/o.npy" $G/sdpa_gqa/out.npy 1e-5
expect 0 "" -- sdpa --q $G/sdpa_scale/q.npy --k $G/sdpa_scale/k.npy --v $G/sdpa_scale/v.npy --out "$T/o.npy" --scale "$(sed -n 's/^scale=//p' $G/sdpa_scale/case.txt)"
close "$T/o.npy" $G/sdpa_scale/out.npy 1e-5

# --- mha on the goldens ---
expect 0 "" -- mha --params $G/mha_seed/params.safetensors --heads "$(sed -n 's/^heads=//p' $G/mha_seed/case.txt)" --query $G/mha_seed/x.npy --out "$T/o.npy" --weights-out "$T/w.npy"
close "$T/o.npy" $G/mha_seed/out.npy 1e-5
close "$T/w.npy" $G/mha_seed/weights.npy 1e-5
H=$(sed -n 's/^heads=//p' $G/mha_torch_heads/case.txt); P=$(sed -n 's/^prefix=//p' $G/mha_torch_heads/case.txt)
expect 0 "" -- mha --params $G/mha_torch_heads/params.safetensors --prefix "$P" --heads "$H" --query $G/mha_torch_heads/x.npy --mask $G/mha_torch_heads/mask.npy --key-padding $G/mha_torch_heads/key_padding.npy --out "$T/o.npy" --weights-out "$T/w.npy"
close "$T/o.npy" $G/mha_torch_heads/out.npy 1e-5
close "$T/w.npy" $G/mha_torch_heads/weights.npy 1e-5
H=$(sed -n 's/^heads=//p' $G/mha_torch_avg/case.txt)
expect 0 "" -- mha --params $G/mha_torch_avg/params.safetensors --heads "$H" --query $G/mha_torch_avg/x.npy --out "$T/o.npy" --weights-out "$T/w.npy" --average-weights $( [ -f $G/mha_torch_avg/key_padding.npy ] && echo --key-padding $G/mha_torch_avg/key_padding.npy ) $( [ -f $G/mha_torch_avg/mask.npy ] && echo --mask $G/mha_torch_avg/mask.npy )
close "$T/o.npy" $G/mha_torch_avg/out.npy 1e-5
close "$T/w.npy" $G/mha_torch_avg/weights.npy 1e-5
H=$(sed -n 's/^heads=//p' $G/mha_torch_kvdim/case.txt)
expect 0 "" -- mha --params $G/mha_torch_kvdim/params.safetensors --heads "$H" --query $G/mha_torch_kvdim/x.npy --key $G/mha_torch_kvdim/key.npy --value $G/mha_torch_kvdim/value.npy --mask $G/mha_torch_kvdim/mask.npy --key-padding $G/mha_torch_kvdim/key_padding.npy --out "$T/o.npy" --weights-out "$T/w.npy"
close "$T/w.npy" $G/mha_torch_kvdim/weights.npy 1e-5
close "$T/o.npy" $G/mha_torch_kvdim/out.npy 1e-5

# --- the demo and the small commands ---
expect 0 "" -- demo
expect 0 "" -- version
expect 0 "" -- help

# --- bad input: exit 1 (data) or 2 (command line), one line, no output ---
Q=$G/sdpa_plain/q.npy K=$G/sdpa_plain/k.npy V=$G/sdpa_plain/v.npy
O="$T/never.npy"
printf 'garbage, not an npy file' >"$T/garbage.npy"
head -c 100 $Q >"$T/truncated.npy"
expect 2 "$O" -- sdpa --q $Q --k $K --v $V
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --bogus 1
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --mask-mode keep
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --mask $Q --mask-mode sometimes
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --threads many
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --scale x
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --causal=sideways
expect 2 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --q $Q
expect 2 "" -- frobnicate
expect 1 "$O" -- sdpa --q "$T/missing.npy" --k $K --v $V --out "$O"
expect 1 "$O" -- sdpa --q "$T/garbage.npy" --k $K --v $V --out "$O"
expect 1 "$O" -- sdpa --q "$T/truncated.npy" --k $K --v $V --out "$O"
expect 1 "$O" -- sdpa --q $G/mha_seed/x.npy --k $K --v $V --out "$O"
expect 1 "$O" -- sdpa --q $Q --k $G/sdpa_dv/k.npy --v $V --out "$O"
expect 1 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --mask $G/sdpa_dv/q.npy
expect 1 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --mask $G/sdpa_keep_4d/mask.npy --mask-mode additive
expect 1 "$O" -- sdpa --q $Q --k $K --v $V --out "$T/no/such/dir/o.npy"
expect 1 "$O" -- sdpa --q $Q --k $K --v $V --out "$O" --weights-out "$T/no/such/dir/w.npy"
expect 2 "$O" -- mha --params $G/mha_seed/params.safetensors --query $G/mha_seed/x.npy --out "$O"
expect 2 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 0 --query $G/mha_seed/x.npy --out "$O"
expect 2 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy --key $G/mha_seed/x.npy --out "$O"
expect 2 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy --out "$O" --average-weights
expect 1 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 7 --query $G/mha_seed/x.npy --out "$O"
expect 1 "$O" -- mha --params "$T/garbage.npy" --heads 2 --query $G/mha_seed/x.npy --out "$O"
expect 1 "$O" -- mha --params $G/mha_seed/params.safetensors --prefix nope. --heads 2 --query $G/mha_seed/x.npy --out "$O"
expect 1 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 2 --query $Q --out "$O"
expect 1 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy --mask $Q --out "$O"
expect 1 "$O" -- mha --params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy --key-padding $Q --out "$O"

echo "test_cli: $pass passed, $fail failed"
[ "$fail" = 0 ]
