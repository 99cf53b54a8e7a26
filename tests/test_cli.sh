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

# expect CODE OUTFILE -- ARGS: exit status CODE; on failure one stderr line, no OUTFILE and no $T/never*
# (the failure cases name every output they ask for $T/never*), and never a temporary file in $T
# (the temporaries are hidden: .attn.tmp.*). WRAP=(cmd...) runs attn under cmd.
WRAP=()
expect() {
  local code=$1 out=$2; shift 3
  [ "$code" = 0 ] || rm -f "$T"/never*  # one failure must not make the next case fail too
  ${WRAP[@]+"${WRAP[@]}"} "$ATTN" "$@" >"$T/stdout" 2>"$T/stderr"
  local rc=$?
  if [ "$rc" != "$code" ]; then bad "attn $* exited $rc, want $code: $(cat "$T/stderr")"; return; fi
  if [ "$code" != 0 ]; then
    local lines; lines=$(wc -l <"$T/stderr")
    if [ "$lines" != 1 ] || ! grep -q '^attn: ' "$T/stderr"; then bad "attn $*: want one 'attn: ' line on stderr, got: $(cat "$T/stderr")"; return; fi
    if [ -n "$out" ] && [ -e "$out" ]; then bad "attn $*: left $out behind"; return; fi
    if ls "$T" | grep -q '^never'; then bad "attn $*: left $(ls "$T" | grep '^never' | tr '\n' ' ')behind"; rm -f "$T"/never*; return; fi
  fi
  if [ -n "$(find "$T" -name '*.tmp*')" ]; then bad "attn $*: left a temporary file: $(find "$T" -name '*.tmp*')"; return; fi
  ok
}
close() { # close A B TOL
  if "$CMP" "$1" "$2" "$3" >/dev/null; then ok; else bad "$1 differs from $2"; fi
}
differ() { # differ A B: not within 1e-3 of each other
  if "$CMP" "$1" "$2" 1e-3 >/dev/null; then bad "$1 equals $2"; else ok; fi
}
missing() { # missing FILE...: none of them exists
  local f; for f in "$@"; do if [ -e "$f" ]; then bad "$f exists"; return; fi; done; ok
}
# has_tensors FILE NAME...: the safetensors header (plain JSON after 8 bytes) names each tensor
has_tensors() {
  local f=$1 n; shift
  [ -s "$f" ] || { bad "$f missing or empty"; return; }
  for n in "$@"; do
    if ! head -c 65536 "$f" | grep -aqF "\"$n\":{"; then bad "$f has no tensor '$n'"; return; fi
  done
  ok
}
lacks_tensors() { # lacks_tensors FILE NAME...: the header names none of them
  local f=$1 n; shift
  for n in "$@"; do
    if head -c 65536 "$f" | grep -aqF "\"$n\":{"; then bad "$f has a tensor '$n'"; return; fi
  done
  ok
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

# --- sdpa gradients on the goldens: --grad-out G gives the gradients of sum(out * G) ---
bwd() { # bwd CASE [FLAGS...]: forward + backward, all three gradients against the golden
  local d=$G/sdpa_bwd_$1; shift
  rm -f "$T/o.npy" "$T/dq.npy" "$T/dk.npy" "$T/dv.npy"
  expect 0 "" -- sdpa --q $d/q.npy --k $d/k.npy --v $d/v.npy --out "$T/o.npy" --grad-out $d/G.npy \
    --dq-out "$T/dq.npy" --dk-out "$T/dk.npy" --dv-out "$T/dv.npy" --threads 2 "$@"
  close "$T/o.npy" $d/out.npy 1e-5
  close "$T/dq.npy" $d/dq.npy 1e-5
  close "$T/dk.npy" $d/dk.npy 1e-5
  close "$T/dv.npy" $d/dv.npy 1e-5
}
bwd plain
bwd gqa_causal --causal --scale "$(sed -n 's/^scale=//p' $G/sdpa_bwd_gqa_causal/case.txt)"
bwd mqa_br --causal=bottom-right --mask $G/sdpa_bwd_mqa_br/mask.npy --key-padding $G/sdpa_bwd_mqa_br/key_padding.npy
bwd seed --mask $G/sdpa_bwd_seed/mask.npy --mask-mode seed
rm -f "$T/dm.npy"
bwd additive --mask $G/sdpa_bwd_additive/mask.npy --mask-grad-out "$T/dm.npy"
close "$T/dm.npy" $G/sdpa_bwd_additive/dmask.npy 1e-5   # [B, 1, Nq, Nk]: summed over the heads
# each gradient output is optional
D=$G/sdpa_bwd_plain; SQKV="--q $D/q.npy --k $D/k.npy --v $D/v.npy"
rm -f "$T/dq.npy" "$T/dk.npy" "$T/dv.npy"
expect 0 "" -- sdpa $SQKV --out "$T/o.npy" --grad-out $D/G.npy --dk-out "$T/dk.npy"
close "$T/dk.npy" $D/dk.npy 1e-5
missing "$T/dq.npy" "$T/dv.npy"
D=$G/sdpa_bwd_additive
expect 0 "" -- sdpa --q $D/q.npy --k $D/k.npy --v $D/v.npy --mask $D/mask.npy --out "$T/o.npy" --grad-out $D/G.npy --mask-grad-out "$T/dm.npy"
close "$T/dm.npy" $D/dmask.npy 1e-5
# dropout: off at p = 0; with p > 0 a function of the seed alone, whatever the thread count
D=$G/sdpa_bwd_plain
expect 0 "" -- sdpa $SQKV --out "$T/o.npy" --grad-out $D/G.npy --dq-out "$T/dq.npy" --dropout 0 --seed 5
close "$T/o.npy" $D/out.npy 1e-5
close "$T/dq.npy" $D/dq.npy 1e-5
expect 0 "" -- sdpa $SQKV --out "$T/o1.npy" --grad-out $D/G.npy --dq-out "$T/dq1.npy" --dv-out "$T/dv1.npy" --dropout 0.3 --seed 18446744073709551615 --threads 1
expect 0 "" -- sdpa $SQKV --out "$T/o2.npy" --grad-out $D/G.npy --dq-out "$T/dq2.npy" --dv-out "$T/dv2.npy" --dropout 0.3 --seed 18446744073709551615 --threads 3
close "$T/o1.npy" "$T/o2.npy" 0
close "$T/dq1.npy" "$T/dq2.npy" 0
close "$T/dv1.npy" "$T/dv2.npy" 0
differ "$T/o1.npy" $D/out.npy
expect 0 "" -- sdpa $SQKV --out "$T/o3.npy" --dropout 0.3
differ "$T/o3.npy" "$T/o1.npy"
# p = 1 drops everything (PyTorch's zeros): no seed or thread count changes a bit
expect 0 "" -- sdpa $SQKV --out "$T/o4.npy" --grad-out $D/G.npy --dq-out "$T/dq4.npy" --dropout 1 --seed 1 --threads 1
expect 0 "" -- sdpa $SQKV --out "$T/o5.npy" --grad-out $D/G.npy --dq-out "$T/dq5.npy" --dropout 1 --seed 2 --threads 3
close "$T/o4.npy" "$T/o5.npy" 0
close "$T/dq4.npy" "$T/dq5.npy" 0
differ "$T/o4.npy" $D/out.npy
# bench decode runs, checks itself against the oracle and says so
expect 0 "" -- bench decode --batch 2 --kv-seq 300 --heads 4 --kv-heads 2 --dim 16 --dtype bf16 --repeat 2 --json
if grep -q '"op":"decode"' "$T/stdout" && grep -Eq '"oracle_rel_l2":[0-9.e-]+' "$T/stdout"; then ok; else bad "bench decode --json: $(cat "$T/stdout")"; fi
# and over an attn_kv_cache in a block format (keys q4_0, values q8_0), checked against the oracle on what it stores
expect 0 "" -- bench decode --batch 2 --kv-seq 300 --heads 4 --kv-heads 2 --dim 64 --k-dtype q4_0 --v-dtype q8_0 --repeat 2 --json
if grep -q '"k_dtype":"q4_0","v_dtype":"q8_0","kv_cache":true' "$T/stdout" && grep -Eq '"oracle_rel_l2":[0-9.]+e-0[6-9]' "$T/stdout"; then ok; else bad "bench decode q4_0/q8_0: $(cat "$T/stdout")"; fi
# rows of mixed lengths on a linear cache and on a paged one (blocks of 16, q8_0 keys): the bytes read are the lengths' sum
# (--interleaved: the rows grow together; --scatter: the same in a pool crowded by fillers, so
# each row's blocks lie one apart)
for how in "--cache" "--paged 16 --k-dtype q8_0" "--paged 16 --interleaved" "--paged 16 --scatter"; do
  expect 0 "" -- bench decode --batch 3 --lengths 40,300,7 --heads 4 --kv-heads 2 --dim 32 $how --repeat 2 --json
  if grep -q '"kv_tokens":347,' "$T/stdout" && grep -Eq '"oracle_rel_l2":[0-9.]+e-0[6-9]' "$T/stdout"; then ok; else bad "bench decode $how --lengths: $(cat "$T/stdout")"; fi
done

# --kv-dtype: k and v rounded to halves; the stored-halves forward and the rounded-f32 backward agree
D=$G/sdpa_bwd_plain
expect 0 "" -- sdpa $SQKV --out "$T/oh.npy" --kv-dtype f16
expect 0 "" -- sdpa $SQKV --out "$T/ohb.npy" --kv-dtype f16 --grad-out $D/G.npy --dq-out "$T/dqh.npy"
close "$T/oh.npy" "$T/ohb.npy" 1e-6
close "$T/oh.npy" $D/out.npy 5e-3
expect 0 "" -- sdpa $SQKV --out "$T/obf.npy" --kv-dtype bf16 --threads 1
close "$T/obf.npy" $D/out.npy 3e-2
differ "$T/obf.npy" $D/out.npy
expect 0 "" -- sdpa $SQKV --out "$T/o32.npy" --kv-dtype f32
close "$T/o32.npy" $D/out.npy 1e-6
expect 2 "$T/never_o.npy" -- sdpa $SQKV --out "$T/never_o.npy" --kv-dtype f8
# --cu-seqlens: the golden's two batch entries ([2, 2, 7, 8]) packed into [1, 2, 14, 8] give each
# entry's answer run alone; bad offsets are one line, exit 1, and no output written or replaced
npy_hdr() { # npy_hdr DESCR SHAPE: a 128-byte .npy v1 header
  printf '\x93NUMPY\x01\x00\x76\x00%-117s\n' "{'descr': '$1', 'fortran_order': False, 'shape': ($2), }"
}
chunk() { tail -c +$((129 + $2 * 224)) "$1" | head -c 224; } # chunk F I: the I-th [7, 8] f32 block after the header
for x in q k v; do
  for b in 0 1; do { npy_hdr '<f4' '1, 2, 7, 8'; chunk $G/sdpa_plain/$x.npy $((2 * b)); chunk $G/sdpa_plain/$x.npy $((2 * b + 1)); } >"$T/vl_${x}$b.npy"; done
  { npy_hdr '<f4' '1, 2, 14, 8'; for h in 0 1; do chunk $G/sdpa_plain/$x.npy $h; chunk $G/sdpa_plain/$x.npy $((2 + h)); done; } >"$T/vl_$x.npy"
done
{ npy_hdr '<i8' '3,'; printf '\x00\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00\x0e\x00\x00\x00\x00\x00\x00\x00'; } >"$T/cu64.npy"
{ npy_hdr '<i4' '3,'; printf '\x00\x00\x00\x00\x07\x00\x00\x00\x0e\x00\x00\x00'; } >"$T/cu32.npy"
VL="--q $T/vl_q.npy --k $T/vl_k.npy --v $T/vl_v.npy"
for c in "" "--causal=bottom-right --window 3"; do
  expect 0 "" -- sdpa $VL --out "$T/vl_o.npy" --cu-seqlens "$T/cu64.npy" $c
  expect 0 "" -- sdpa $VL --out "$T/vl_o32.npy" --cu-seqlens "$T/cu32.npy" --cu-seqlens-k "$T/cu64.npy" $c
  close "$T/vl_o.npy" "$T/vl_o32.npy" 0
  for b in 0 1; do expect 0 "" -- sdpa --q $T/vl_q$b.npy --k $T/vl_k$b.npy --v $T/vl_v$b.npy --out "$T/vl_o$b.npy" $c; done
  # the packed answer from the two: head h of entry 0, then of entry 1
  { npy_hdr '<f4' '1, 2, 14, 8'; for h in 0 1; do chunk "$T/vl_o0.npy" $h; chunk "$T/vl_o1.npy" $h; done; } >"$T/vl_want.npy"
  close "$T/vl_o.npy" "$T/vl_want.npy" 1e-6
done
expect 0 "" -- sdpa $VL --out "$T/vl_o.npy" --cu-seqlens "$T/cu64.npy" --grad-out $T/vl_q.npy --dq-out "$T/vl_dq.npy"
{ npy_hdr '<i8' '3,'; printf '\x00\x00\x00\x00\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x00\x00\x0d\x00\x00\x00\x00\x00\x00\x00'; } >"$T/cu_short.npy"
{ npy_hdr '<i8' '3,'; printf '\x00\x00\x00\x00\x00\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff\x0e\x00\x00\x00\x00\x00\x00\x00'; } >"$T/cu_neg.npy"
{ npy_hdr '<f4' '3,'; printf '\x00\x00\x00\x00\x00\x00\xf0\x40\x00\x00\x60\x41'; } >"$T/cu_frac.npy" # 0, 7.5, 14
cp "$T/vl_want.npy" "$T/vl_keep.npy"
for cu in cu_short cu_neg cu_frac; do
  expect 1 "$T/never_o.npy" -- sdpa $VL --out "$T/never_o.npy" --cu-seqlens "$T/$cu.npy"
  expect 1 "" -- sdpa $VL --out "$T/vl_keep.npy" --cu-seqlens "$T/$cu.npy"
  if cmp -s "$T/vl_keep.npy" "$T/vl_want.npy"; then ok; else bad "--cu-seqlens $cu replaced an output"; fi
done
# bench sdpa --lengths: the packed batch and the padded one, each checked against the oracle on one sequence
for m in "" --padded; do
  expect 0 "" -- bench sdpa --lengths 5,0,17,40 --heads 2 --kv-heads 1 --dim 8 --causal --repeat 1 --json $m
  if grep -Eq '"mode":"(packed|padded)".*"oracle_rel_l2":[0-9.]+e-0[6-9]' "$T/stdout"; then ok; else bad "bench sdpa --lengths $m: $(cat "$T/stdout")"; fi
done
# with --backward (the padded batch's padding rows carry no gradient), and in bf16 (the oracle on the rounded inputs)
for m in "" --padded; do
  expect 0 "" -- bench sdpa --lengths 5,0,17,40 --heads 2 --kv-heads 1 --dim 16 --causal --repeat 1 --json --backward $m
  if grep -Eq '"backward_oracle_rel_l2":[0-9.]+e-0[6-9].*"oracle_rel_l2":[0-9.]+e-0[6-9]' "$T/stdout"; then ok; else bad "bench sdpa --lengths --backward $m: $(cat "$T/stdout")"; fi
  expect 0 "" -- bench sdpa --lengths 70,3,33 --heads 2 --dim 32 --repeat 1 --json --backward --dtype bf16 $m
  below_1e2='(0\.00[0-9]+|[0-9.]+e-0[3-9])' # bf16 tiles: ~2e-3; bf16 widened to fp32 (no AMX): ~1e-7
  if grep -Eq "\"dtype\":\"bf16\".*\"backward_oracle_rel_l2\":$below_1e2,.*\"oracle_rel_l2\":$below_1e2}" "$T/stdout"; then ok; else bad "bench sdpa --lengths --dtype bf16 $m: $(cat "$T/stdout")"; fi
done
expect 2 "" -- bench sdpa --lengths 5,8 --heads 2 --dim 8 --window 4
expect 2 "" -- bench sdpa --lengths 5,8 --heads 2 --dim 8 --dtype f8
expect 2 "" -- bench sdpa --lengths 5,x --heads 2 --dim 8
expect 2 "" -- bench sdpa --lengths 5 --heads 2 --dim 8 --batch 2
expect 2 "" -- bench sdpa --batch 1 --seq 8 --heads 2 --dim 8 --padded
expect 1 "$T/never_o.npy" -- sdpa $VL --out "$T/never_o.npy" --cu-seqlens "$T/cu64.npy" --key-padding $G/sdpa_plain/q.npy
expect 2 "$T/never_o.npy" -- sdpa $VL --out "$T/never_o.npy" --cu-seqlens-k "$T/cu64.npy"

# --precision reaches the context (test_half checks what each policy computes): bf16 and f16 are close to
# the f32 answer (this case is decode-sized, which stays fp32), fp32 is the f32 answer, a wrong name is refused
expect 0 "" -- sdpa $SQKV --out "$T/opb.npy" --precision bf16
close "$T/opb.npy" $D/out.npy 3e-2
expect 0 "" -- sdpa $SQKV --out "$T/opf.npy" --precision fp32
close "$T/opf.npy" $D/out.npy 1e-6
expect 0 "" -- sdpa $SQKV --out "$T/oph.npy" --precision f16
close "$T/oph.npy" $D/out.npy 3e-3
expect 2 "$T/never_o.npy" -- sdpa $SQKV --out "$T/never_o.npy" --precision f8

# --- mha on the goldens ---
expect 0 "" -- mha --params $G/mha_seed/params.safetensors --heads "$(sed -n 's/^heads=//p' $G/mha_seed/case.txt)" --query $G/mha_seed/x.npy --out "$T/o.npy" --weights-out "$T/w.npy"
close "$T/o.npy" $G/mha_seed/out.npy 1e-5
close "$T/w.npy" $G/mha_seed/weights.npy 1e-5
# --clip-qkv: a bound no projection reaches changes nothing, a tight one changes the output; 0 is refused
SEEDH=$(sed -n 's/^heads=//p' $G/mha_seed/case.txt)
expect 0 "" -- mha --params $G/mha_seed/params.safetensors --heads "$SEEDH" --query $G/mha_seed/x.npy --out "$T/oc.npy" --clip-qkv 1e6
close "$T/oc.npy" $G/mha_seed/out.npy 1e-5
expect 0 "" -- mha --params $G/mha_seed/params.safetensors --heads "$SEEDH" --query $G/mha_seed/x.npy --out "$T/oc.npy" --clip-qkv 0.01
differ "$T/oc.npy" $G/mha_seed/out.npy
expect 2 "$T/never_oc.npy" -- mha --params $G/mha_seed/params.safetensors --heads "$SEEDH" --query $G/mha_seed/x.npy --out "$T/never_oc.npy" --clip-qkv 0
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

# --- mha gradients: every parameter under the file's own names (prefix kept), and the inputs' ---
# (the gradients' values are the library's tests' business; here: the file and its names)
mha_grads() { # mha_grads CASE [FLAGS...]
  local d=$G/$1; shift
  rm -f "$T/grads.safetensors"
  expect 0 "" -- mha --params $d/params.safetensors --prefix "$(sed -n 's/^prefix=//p' $d/case.txt)" \
    --heads "$(sed -n 's/^heads=//p' $d/case.txt)" --query $d/x.npy --out "$T/o.npy" \
    --grad-out $d/out.npy --grads-out "$T/grads.safetensors" "$@"
}
mha_grads mha_seed
close "$T/o.npy" $G/mha_seed/out.npy 1e-5
has_tensors "$T/grads.safetensors" wq.weight wq.bias wk.weight wk.bias wv.weight wv.bias dense.weight dense.bias query
lacks_tensors "$T/grads.safetensors" key value
mha_grads mha_seed --dropout 0.25 --seed 3
has_tensors "$T/grads.safetensors" wq.weight dense.bias query
P=encoder.layers.0.self_attn.
mha_grads mha_torch_heads --mask $G/mha_torch_heads/mask.npy --key-padding $G/mha_torch_heads/key_padding.npy
has_tensors "$T/grads.safetensors" ${P}in_proj_weight ${P}in_proj_bias ${P}out_proj.weight ${P}out_proj.bias query
lacks_tensors "$T/grads.safetensors" in_proj_weight encoder.layers.0.norm1.weight
mha_grads mha_torch_kvdim --key $G/mha_torch_kvdim/key.npy --value $G/mha_torch_kvdim/value.npy
has_tensors "$T/grads.safetensors" q_proj_weight k_proj_weight v_proj_weight in_proj_bias out_proj.weight out_proj.bias query key value
mha_grads mha_torch_nobias
has_tensors "$T/grads.safetensors" in_proj_weight out_proj.weight query
lacks_tensors "$T/grads.safetensors" in_proj_bias out_proj.bias

# --- layer L of a Hugging Face checkpoint as saved (tests/golden_hf, scripts/make_hf_goldens.py):
# the family's prefix found, config.json's heads, head_dim, QK-norm, RoPE, window, softcap and scale
# read, a sharded checkpoint followed through its index; against transformers' module in float64 ---
GH=golden_hf O="$T/never.npy"
for c in llama qwen3_sharded gemma2 gpt2 bert; do
  d=$GH/$c
  layer=$(sed -n 's/^layer=//p' $d/case.txt); w=$(sed -n 's/^weights=//p' $d/case.txt)
  flags=(); [ "$(sed -n 's/^causal=//p' $d/case.txt)" = 1 ] && flags+=(--causal)
  [ "$(sed -n 's/^positions=//p' $d/case.txt)" = 1 ] && flags+=(--positions $d/positions.npy)
  expect 0 "" -- mha --hf-config $d/config.json --params $d/$w --layer "$layer" --query $d/x.npy --out "$T/o.npy" "${flags[@]}"
  close "$T/o.npy" $d/out.npy 1e-5
done
# T5: its relative position bias is the caller's additive mask, and is required
expect 0 "" -- mha --hf-config $GH/t5/config.json --params $GH/t5/model.safetensors --layer 0 --query $GH/t5/x.npy --mask $GH/t5/mask.npy --out "$T/o.npy"
close "$T/o.npy" $GH/t5/out.npy 1e-5
expect 2 "$O" -- mha --hf-config $GH/t5/config.json --params $GH/t5/model.safetensors --layer 0 --query $GH/t5/x.npy --out "$T/never.npy"
# the positions matter (row 1's have gaps), and so does the layer
expect 0 "" -- mha --hf-config $GH/llama/config.json --params $GH/llama/model.safetensors --layer 1 --query $GH/llama/x.npy --out "$T/o.npy" --causal
differ "$T/o.npy" $GH/llama/out.npy
expect 0 "" -- mha --hf-config $GH/llama/config.json --params $GH/llama/model.safetensors --layer 0 --query $GH/llama/x.npy --out "$T/o.npy" --causal --positions $GH/llama/positions.npy
differ "$T/o.npy" $GH/llama/out.npy
# the same Llama layer by hand: its prefix, heads, RoPE flags (llama3 scaling) and positions
expect 0 "" -- mha --params $GH/llama/model.safetensors --prefix model.layers.1.self_attn. --heads 4 --kv-heads 2 --query $GH/llama/x.npy --out "$T/o.npy" --causal --rope 500000 --rope-scaling llama3:8:1:4:16 --positions $GH/llama/positions.npy
close "$T/o.npy" $GH/llama/out.npy 1e-5
# --rope-scaling longrope: one short and one long factor per rotary pair (head_dim 8: four), the long ones
# past P. Every factor 4 with F = 1 (attention factor 1) is linear:4 in either regime; other factors differ.
LL="--params $GH/llama/model.safetensors --prefix model.layers.1.self_attn. --heads 4 --kv-heads 2 --query $GH/llama/x.npy --causal --rope 500000 --positions $GH/llama/positions.npy"
expect 0 "" -- mha $LL --out "$T/olin.npy" --rope-scaling linear:4
expect 0 "" -- mha $LL --out "$T/olr.npy" --rope-scaling longrope:1:100000:4,4,4,4:1,1,1,1
close "$T/olr.npy" "$T/olin.npy" 1e-6
expect 0 "" -- mha $LL --out "$T/olr.npy" --rope-scaling longrope:1:2:1,1,1,1:4,4,4,4
close "$T/olr.npy" "$T/olin.npy" 1e-6
expect 0 "" -- mha $LL --out "$T/olr.npy" --rope-scaling longrope:1:2:4,4,4,4:1,2,4,4
differ "$T/olr.npy" "$T/olin.npy"
expect 2 "$T/never.npy" -- mha $LL --out "$T/never.npy" --rope-scaling longrope:1:2:4,4,4:4,4,4,4
expect 2 "$T/never.npy" -- mha $LL --out "$T/never.npy" --rope-scaling longrope:1:2:4,4,4,4
expect 1 "$T/never.npy" -- mha $LL --out "$T/never.npy" --rope-scaling longrope:1:2:4,4,4:4,4,4
# and through a name map: GPT-2's fused Conv1D tensors named by hand
GS="q=h.1.attn.c_attn.weight,k=h.1.attn.c_attn.weight,v=h.1.attn.c_attn.weight,o=h.1.attn.c_proj.weight"
GS="$GS,q_bias=h.1.attn.c_attn.bias,k_bias=h.1.attn.c_attn.bias,v_bias=h.1.attn.c_attn.bias,o_bias=h.1.attn.c_proj.bias"
expect 0 "" -- mha --params $GH/gpt2/model.safetensors --names "$GS" --layout conv1d --heads 4 --scale 0.1767766952966369 --query $GH/gpt2/x.npy --out "$T/o.npy" --causal
close "$T/o.npy" $GH/gpt2/out.npy 1e-5
expect 1 "$O" -- mha --params $GH/gpt2/model.safetensors --names "$GS" --layout linear --heads 4 --scale 0.1767766952966369 --query $GH/gpt2/x.npy --out "$T/never.npy" --causal
# gradients of a sharded Qwen3 layer under the checkpoint's own names, QK-norm's included
expect 0 "" -- mha --hf-config $GH/qwen3_sharded/config.json --params $GH/qwen3_sharded/model.safetensors.index.json --layer 1 --query $GH/qwen3_sharded/x.npy --out "$T/o.npy" --causal --grad-out $GH/qwen3_sharded/x.npy --grads-out "$T/grads.safetensors"
has_tensors "$T/grads.safetensors" model.layers.1.self_attn.q_proj.weight model.layers.1.self_attn.q_norm.weight model.layers.1.self_attn.k_norm.weight model.layers.1.self_attn.o_proj.weight query
expect 0 "" -- mha --hf-config $GH/gpt2/config.json --params $GH/gpt2/model.safetensors --layer 1 --query $GH/gpt2/x.npy --out "$T/o.npy" --causal --grad-out $GH/gpt2/x.npy --grads-out "$T/grads.safetensors"
has_tensors "$T/grads.safetensors" h.1.attn.c_attn.weight h.1.attn.c_attn.bias h.1.attn.c_proj.weight h.1.attn.c_proj.bias query
# what contradicts the config, or is not there
HL="--hf-config $GH/llama/config.json --params $GH/llama/model.safetensors --query $GH/llama/x.npy"
expect 1 "$O" -- mha $HL --layer 2 --out "$T/never.npy"
expect 2 "$O" -- mha $HL --layer 0 --heads 4 --out "$T/never.npy"
expect 2 "$O" -- mha $HL --layer 0 --window 3 --out "$T/never.npy"
expect 2 "$O" -- mha $HL --out "$T/never.npy"
expect 1 "$O" -- mha $HL --layer 0 --positions $GH/llama/x.npy --out "$T/never.npy"
expect 1 "$O" -- mha --hf-config $GH/bert/config.json --params $GH/llama/model.safetensors --query $GH/llama/x.npy --layer 0 --out "$T/never.npy"
expect 2 "$O" -- mha --params $GH/gpt2/model.safetensors --names "q=a" --heads 4 --query $GH/gpt2/x.npy --out "$T/never.npy"
expect 2 "$O" -- mha --params $GH/gpt2/model.safetensors --layout conv1d --heads 4 --query $GH/gpt2/x.npy --out "$T/never.npy"
expect 1 "$O" -- mha --params $GH/gpt2/model.safetensors --names "q=a,k=b,v=c,o=d" --heads 4 --query $GH/gpt2/x.npy --out "$T/never.npy"
expect 2 "$O" -- mha --params $GH/llama/model.safetensors --prefix model.layers.1.self_attn. --heads 4 --kv-heads 2 --query $GH/llama/x.npy --out "$T/never.npy" --rope-scaling linear:2
expect 2 "$O" -- mha --params $GH/llama/model.safetensors --prefix model.layers.1.self_attn. --heads 4 --kv-heads 2 --query $GH/llama/x.npy --out "$T/never.npy" --rope 10000 --rope-scaling cubic:2
expect 2 "$O" -- mha --params $GH/llama/model.safetensors --prefix model.layers.1.self_attn. --heads 4 --kv-heads 2 --query $GH/llama/x.npy --out "$T/never.npy" --positions $GH/llama/positions.npy

# --- the benchmark's backward ---
expect 0 "" -- bench sdpa --batch 1 --heads 4 --kv-heads 2 --seq 24 --dim 8 --causal --backward --repeat 1 --threads 2 --json
for f in backward_median_s backward_gflops backward_fraction_of_peak fwd_bwd_median_s fwd_bwd_gflops backward_oracle_rel_l2; do
  if grep -q "\"$f\":[0-9]" "$T/stdout" && [ "$(grep -c '^{' "$T/stdout")" = 1 ]; then ok; else bad "bench --backward --json: no $f in $(cat "$T/stdout")"; fi
done

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
# the gradients' flags
D=$G/sdpa_bwd_additive; BQKV="--q $D/q.npy --k $D/k.npy --v $D/v.npy"; DG="--grad-out $D/G.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" $DG
expect 2 "$O" -- sdpa $BQKV --out "$O" --dq-out "$T/never_dq.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" --dk-out "$T/never_dk.npy" --dv-out "$T/never_dv.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" --mask $D/mask.npy --mask-grad-out "$T/never_dm.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" $DG --mask-grad-out "$T/never_dm.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" $DG --mask $D/mask.npy --mask-mode seed --mask-grad-out "$T/never_dm.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" $DG --dq-out "$O"
expect 2 "$O" -- sdpa $BQKV --out "$O" $DG --dq-out "$T/never_d.npy" --dk-out "$T/never_d.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" $DG --dq-out ""
expect 2 "$O" -- sdpa $BQKV --out "$O" --grad-out "" --dq-out "$T/never_dq.npy"
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout 1.5
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout -0.1
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout nan
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout half
expect 2 "$O" -- sdpa $BQKV --out "$O" --seed 3
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout 0.1 --seed -1
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout 0.1 --seed 18446744073709551616
expect 2 "$O" -- sdpa $BQKV --out "$O" --dropout 0.1 --seed 0x10
# bad data: exit 1, and none of the outputs (those written before the failing one included) stays
ALLG="--dq-out $T/never_dq.npy --dk-out $T/never_dk.npy --dv-out $T/never_dv.npy"
expect 1 "$O" -- sdpa $BQKV --out "$O" --grad-out $G/sdpa_bwd_gqa_causal/G.npy $ALLG
expect 1 "$O" -- sdpa $BQKV --out "$O" --grad-out $G/sdpa_bwd_mqa_br/key_padding.npy $ALLG
expect 1 "$O" -- sdpa $BQKV --out "$O" --grad-out "$T/missing.npy" $ALLG
expect 1 "$O" -- sdpa $BQKV --out "$O" --grad-out "$T/garbage.npy" $ALLG
expect 1 "$O" -- sdpa $BQKV --out "$O" $DG --mask $G/sdpa_keep_4d/mask.npy --mask-grad-out "$T/never_dm.npy"
expect 1 "$O" -- sdpa $BQKV --out "$O" $DG --dq-out "$T/never_dq.npy" --dk-out "$T/no/such/dir/dk.npy"
expect 1 "$O" -- sdpa $BQKV --out "$O" --weights-out "$T/never_w.npy" $DG $ALLG --mask $D/mask.npy --mask-grad-out "$T/no/such/dir/dm.npy"
expect 1 "$O" -- sdpa $BQKV --out "$O" --key-padding $D/q.npy
MS="--params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy"
expect 2 "$O" -- mha $MS --out "$O" --grad-out $G/mha_seed/out.npy
expect 2 "$O" -- mha $MS --out "$O" --grads-out "$T/never_g.safetensors"
expect 2 "$O" -- mha $MS --out "$O" --grad-out $G/mha_seed/out.npy --grads-out "$O"
expect 2 "$O" -- mha $MS --out "$O" --seed 1
expect 2 "$O" -- mha $MS --out "$O" --dropout 2
expect 1 "$O" -- mha $MS --out "$O" --weights-out "$T/never_w.npy" --grad-out $Q --grads-out "$T/never_g.safetensors"
expect 1 "$O" -- mha $MS --out "$O" --grad-out $G/mha_torch_kvdim/x.npy --grads-out "$T/never_g.safetensors"
expect 1 "$O" -- mha $MS --out "$O" --grad-out "$T/garbage.npy" --grads-out "$T/never_g.safetensors"
expect 1 "$O" -- mha $MS --out "$O" --weights-out "$T/never_w.npy" --grad-out $G/mha_seed/out.npy --grads-out "$T/no/such/dir/g.safetensors"
expect 2 "$O" -- bench sdpa --batch 1 --heads 2 --seq 8 --dim 8 --backward --kernel nope
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 2 --dim 8 --dtype f8
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 2 --dim 8 --dtype q8_0
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 2 --dim 32 --dtype q4_0 --compare
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 3 --kv-heads 2 --dim 8
expect 2 "$O" -- bench decode --batch 1 --heads 2 --dim 8
expect 2 "$O" -- bench decode --batch 2 --lengths 40,0 --heads 2 --dim 8 --paged 16
expect 2 "$O" -- bench decode --batch 2 --lengths 40 --heads 2 --dim 8
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 2 --dim 8 --paged 0
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --lengths 64 --heads 2 --dim 8
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 2 --dim 8 --cache --interleaved
expect 2 "$O" -- bench decode --batch 1 --kv-seq 64 --heads 2 --dim 8 --scatter
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

# --- attn map: attention weights as a PNG (only where built with libpng) ---
is_png() { # is_png FILE: exists and starts with the PNG signature
  if [ -s "$1" ] && [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ]; then ok; else bad "$1 is not a PNG"; fi
}
png_size() { # png_size FILE: "WIDTH HEIGHT" from the IHDR chunk
  od -An -tu1 -j16 -N8 "$1" | awk '{print $1*16777216+$2*65536+$3*256+$4, $5*16777216+$6*65536+$7*256+$8}'
}
"$ATTN" map >/dev/null 2>"$T/stderr"
HAVE_PNG=1
if grep -q 'built without libpng' "$T/stderr"; then
  HAVE_PNG=0
  echo "test_cli: attn map built without libpng: only its one-line refusal is tested"
  expect 1 "$T/never.png" -- map --weights $G/mha_seed/weights.npy --png "$T/never.png"
else
  MP="--params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy"
  printf 'the\ncat\nsat\non\nthe\nmat\nnow\n' >"$T/tok7.txt"
  printf 'a\r\nb\r\nc\r\n' >"$T/tok3.txt"
  rm -f "$T"/map*.png
  expect 0 "" -- map $MP --png "$T/map_p.png" --tokens "$T/tok7.txt"
  is_png "$T/map_p.png"
  # the same weights through `attn mha --weights-out` draw the same picture
  expect 0 "" -- mha $MP --out "$T/o.npy" --weights-out "$T/w.npy"
  expect 0 "" -- map --weights "$T/w.npy" --png "$T/map_w.png" --tokens "$T/tok7.txt"
  if cmp -s "$T/map_p.png" "$T/map_w.png"; then ok; else bad "map from --params and from --weights differ"; fi
  expect 0 "" -- map --weights "$T/w.npy" --batch 1 --png "$T/map_b1.png" --tokens "$T/tok7.txt"
  if cmp -s "$T/map_w.png" "$T/map_b1.png"; then bad "--batch 1 drew batch 0"; else ok; fi
  expect 0 "" -- map --weights "$T/w.npy" --png "$T/map_nolabels.png"
  is_png "$T/map_nolabels.png"
  # a UTF-8 sequence is one '?', as is a stray byte; labels are cut at 10 glyphs, not bytes
  printf '\303\251\n\342\202\254x\n\377\n\304\240the\n%s\n?\n?\n' "$(printf '\303\251%.0s' $(seq 11))" >"$T/tok_utf8.txt"
  printf '?\n?x\n?\n?the\n??????????\n?\n?\n' >"$T/tok_ascii.txt"
  expect 0 "" -- map --weights "$T/w.npy" --png "$T/map_utf8.png" --tokens "$T/tok_utf8.txt"
  expect 0 "" -- map --weights "$T/w.npy" --png "$T/map_ascii.png" --tokens "$T/tok_ascii.txt"
  if cmp -s "$T/map_utf8.png" "$T/map_ascii.png"; then ok; else bad "UTF-8 labels drew other than their '?' glyphs"; fi
  printf 'the\ncat\000\nsat\non\nthe\nmat\nnow\n' >"$T/tok_nul.txt"
  expect 1 "$T/never.png" -- map --weights "$T/w.npy" --png "$T/never.png" --tokens "$T/tok_nul.txt"
  if grep -q "line 2 holds a NUL byte" "$T/stderr"; then ok; else bad "a NUL in a token file: $(cat "$T/stderr")"; fi
  # one head [Nq, Nk], rank 3 [H, Nq, Nk], a cross-attention layer, --key alone
  expect 0 "" -- map --weights $G/sdpa_plain/weights.npy --png "$T/map_sdpa.png"
  is_png "$T/map_sdpa.png"
  CP="--params $G/mha_seed_cross/params.safetensors --heads $(sed -n 's/^heads=//p' $G/mha_seed_cross/case.txt)"
  expect 0 "" -- map $CP --query $G/mha_seed_cross/x.npy --key $G/mha_seed_cross/key.npy --value $G/mha_seed_cross/value.npy --png "$T/map_cross.png"
  is_png "$T/map_cross.png"
  expect 0 "" -- map $MP --key $G/mha_seed/x.npy --causal --png "$T/map_causal.png"
  is_png "$T/map_causal.png"
  # more heads, a wider picture; labels make it larger
  read -r w1 h1 <<<"$(png_size "$T/map_nolabels.png")"
  read -r w2 h2 <<<"$(png_size "$T/map_w.png")"
  if [ "$w1" -gt 0 ] && [ "$h1" -gt 0 ] && [ "$w2" -gt "$w1" ] && [ "$h2" -gt "$h1" ]; then ok; else bad "map sizes $w1x$h1 (no labels) vs $w2x$h2 (labels)"; fi
  # bad command lines: exit 2; bad data: exit 1; never a PNG left behind
  NP="$T/never.png"
  expect 2 "$NP" -- map --weights "$T/w.npy"
  expect 2 "$NP" -- map --png "$NP"
  expect 2 "$NP" -- map --weights "$T/w.npy" $MP --png "$NP"
  expect 2 "$NP" -- map --weights "$T/w.npy" --heads 2 --png "$NP"
  expect 2 "$NP" -- map --params $G/mha_seed/params.safetensors --query $G/mha_seed/x.npy --png "$NP"
  expect 2 "$NP" -- map --params $G/mha_seed/params.safetensors --heads 2 --png "$NP"
  expect 2 "$NP" -- map $MP --value $G/mha_seed/x.npy --png "$NP"
  expect 2 "$NP" -- map --weights "$T/w.npy" --png "$NP" --batch -1
  expect 2 "$NP" -- map --weights "$T/w.npy" --png "$NP" --colour red
  expect 2 "$NP" -- map --weights "$T/w.npy" --png ""
  expect 1 "$NP" -- map --weights "$T/w.npy" --png "$NP" --batch 2
  expect 1 "$NP" -- map --weights "$T/w.npy" --png "$NP" --tokens "$T/tok3.txt"
  expect 1 "$NP" -- map --weights "$T/w.npy" --png "$NP" --tokens "$T/missing.txt"
  expect 1 "$NP" -- map --weights "$T/w.npy" --png "$NP" --key-tokens "$T/tok3.txt"
  expect 1 "$NP" -- map --weights "$T/garbage.npy" --png "$NP"
  expect 1 "$NP" -- map --weights $G/mha_seed/params.safetensors --png "$NP"
  expect 1 "$NP" -- map --weights $G/sdpa_keep_4d/mask.npy --png "$NP"
  expect 1 "$NP" -- map --weights "$T/w.npy" --png "$T/no/such/dir/map.png"
  expect 1 "$NP" -- map --params $G/mha_seed/params.safetensors --heads 7 --query $G/mha_seed/x.npy --png "$NP"
  expect 1 "$NP" -- map --params $G/mha_seed/params.safetensors --heads 2 --query $Q --png "$NP"
  expect 1 "$NP" -- map $MP --batch 5 --png "$NP"
  # a failed run keeps an existing PNG as it was
  cp "$T/map_w.png" "$T/keep.png"
  expect 1 "" -- map --weights "$T/w.npy" --png "$T/keep.png" --tokens "$T/tok3.txt"
  if cmp -s "$T/map_w.png" "$T/keep.png"; then ok; else bad "a failed map changed an existing PNG"; fi
fi
# --- options of recent models: --window, --chunk, --softcap, --alibi, --sinks ---
# npy_f32x2 FILE BYTES: a float32 [2] .npy file (a 128-byte header; BYTES as printf escapes)
npy_f32x2() {
  printf '\x93NUMPY\x01\x00\x76\x00%-117s\n' "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }" >"$1"
  printf "$2" >>"$1"
}
npy_f32x2 "$T/sinks.npy" '\x00\x00\x00\x3f\x00\x00\xa0\xbf'    # [0.5, -1.25]
npy_f32x2 "$T/nosinks.npy" '\xca\xf2\x49\xf1\xca\xf2\x49\xf1'  # [-1e30, -1e30]: no weight at all
printf '\x93NUMPY\x01\x00\x76\x00%-117s\n' "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }" >"$T/sinks3.npy"
printf '\x00\x00\x00\x3f\x00\x00\x00\x3f\x00\x00\x00\x3f' >>"$T/sinks3.npy"
D=$G/sdpa_plain; PQKV="--q $D/q.npy --k $D/k.npy --v $D/v.npy"   # [2, 2, 7, 8] each
# window 1: each query sees its own key alone, so out = v
expect 0 "" -- sdpa $PQKV --out "$T/o.npy" --window 1
close "$T/o.npy" $D/v.npy 1e-6
# chunks of 1 do the same; chunks wider than the keys are the causal bound alone
expect 0 "" -- sdpa $PQKV --out "$T/o.npy" --chunk 1
close "$T/o.npy" $D/v.npy 1e-6
expect 0 "" -- sdpa --q $G/sdpa_causal_tl/q.npy --k $G/sdpa_causal_tl/k.npy --v $G/sdpa_causal_tl/v.npy --out "$T/o.npy" --chunk 100000
close "$T/o.npy" $G/sdpa_causal_tl/out.npy 1e-5
# a window wider than the keys is the causal bound alone (top-left when --causal is not given)
expect 0 "" -- sdpa --q $G/sdpa_causal_tl/q.npy --k $G/sdpa_causal_tl/k.npy --v $G/sdpa_causal_tl/v.npy --out "$T/o.npy" --window 100000
close "$T/o.npy" $G/sdpa_causal_tl/out.npy 1e-5
D=$G/sdpa_causal_br; RQKV="--q $D/q.npy --k $D/k.npy --v $D/v.npy"
expect 0 "" -- sdpa $RQKV --out "$T/o.npy" --causal=bottom-right --window 11
close "$T/o.npy" $D/out.npy 1e-5
# the fast kernel against the oracle (ATTN_KERNEL=ref) with every option, forward and backward
OPTS="--causal=bottom-right --window 3 --chunk 4 --softcap 2 --alibi --sinks $T/sinks.npy"
expect 0 "" -- sdpa $RQKV --out "$T/o.npy" --weights-out "$T/w.npy" $OPTS
ATTN_KERNEL=ref "$ATTN" sdpa $RQKV --out "$T/o_ref.npy" --weights-out "$T/w_ref.npy" $OPTS && ok || bad "ref sdpa with options"
close "$T/o.npy" "$T/o_ref.npy" 1e-5
close "$T/w.npy" "$T/w_ref.npy" 1e-5
differ "$T/o.npy" $D/out.npy
D=$G/sdpa_bwd_plain
expect 0 "" -- sdpa $SQKV --out "$T/o.npy" --grad-out $D/G.npy --dq-out "$T/dq.npy" --dk-out "$T/dk.npy" --dv-out "$T/dv.npy" --sinks-grad-out "$T/ds.npy" $OPTS
ATTN_KERNEL=ref "$ATTN" sdpa $SQKV --out "$T/o_ref.npy" --grad-out $D/G.npy --dq-out "$T/dq_ref.npy" --dk-out "$T/dk_ref.npy" --dv-out "$T/dv_ref.npy" --sinks-grad-out "$T/ds_ref.npy" $OPTS && ok || bad "ref sdpa backward with options"
for x in o dq dk dv ds; do close "$T/$x.npy" "$T/${x}_ref.npy" 1e-5; done
differ "$T/dq.npy" $D/dq.npy
# each option does something, and its neutral value nothing
D=$G/sdpa_plain
for opt in "--window 2" "--chunk 3" "--softcap 0.5" "--alibi" "--sinks $T/sinks.npy"; do
  expect 0 "" -- sdpa $PQKV --out "$T/o.npy" $opt
  differ "$T/o.npy" $D/out.npy
done
expect 0 "" -- sdpa $PQKV --out "$T/o.npy" --softcap 1e6 --window 0 --chunk 0 --sinks "$T/nosinks.npy"
close "$T/o.npy" $D/out.npy 1e-5
# bad values: a usage error (2) or a failed run (1), one line, no output
O="$T/never_o.npy"
expect 2 "$O" -- sdpa $PQKV --out "$O" --window -1
expect 2 "$O" -- sdpa $PQKV --out "$O" --chunk -2
expect 2 "$O" -- sdpa $PQKV --out "$O" --window 2.5
expect 2 "$O" -- sdpa $PQKV --out "$O" --softcap -1
expect 2 "$O" -- sdpa $PQKV --out "$O" --softcap nan
expect 2 "$O" -- sdpa $PQKV --out "$O" --softcap inf
expect 2 "$O" -- sdpa $PQKV --out "$O" --softcap x
expect 2 "$O" -- sdpa $PQKV --out "$O" --alibi=1
expect 2 "$O" -- sdpa $PQKV --out "$O" --grad-out $G/sdpa_plain/out.npy --sinks-grad-out "$T/never_ds.npy"
expect 2 "$O" -- sdpa $PQKV --out "$O" --sinks-grad-out "$T/never_ds.npy" --sinks "$T/sinks.npy"
expect 1 "$O" -- sdpa $PQKV --out "$O" --sinks "$T/sinks3.npy"
expect 1 "$O" -- sdpa $PQKV --out "$O" --sinks "$T/missing.npy"
expect 1 "$O" -- sdpa $PQKV --out "$O" --sinks "$T/garbage.npy"
expect 1 "$O" -- sdpa $PQKV --out "$O" --sinks $G/sdpa_plain/q.npy
# the layer takes the same flags
MS="--params $G/mha_seed/params.safetensors --heads 2 --query $G/mha_seed/x.npy"
MOPTS="--window 3 --softcap 2 --alibi --sinks $T/sinks.npy"
expect 0 "" -- mha $MS --out "$T/o.npy" $MOPTS
ATTN_KERNEL=ref "$ATTN" mha $MS --out "$T/o_ref.npy" $MOPTS && ok || bad "ref mha with options"
close "$T/o.npy" "$T/o_ref.npy" 1e-5
differ "$T/o.npy" $G/mha_seed/out.npy
expect 0 "" -- mha $MS --out "$T/o.npy" --softcap 1e6 --sinks "$T/nosinks.npy"
close "$T/o.npy" $G/mha_seed/out.npy 1e-5
expect 0 "" -- mha $MS --out "$T/o.npy" $MOPTS --grad-out $G/mha_seed/out.npy --grads-out "$T/g.safetensors"
has_tensors "$T/g.safetensors" query
expect 2 "$O" -- mha $MS --out "$O" --window -3
expect 2 "$O" -- mha $MS --out "$O" --softcap -2
expect 1 "$O" -- mha $MS --out "$O" --sinks "$T/sinks3.npy"

# --- outputs: never an input, staged until every one is written, links followed ---
same() { # same A B: byte for byte (else B is copied over A, so that one failure stays one)
  if cmp -s "$1" "$2"; then ok; else bad "$1 changed (differs from $2)"; cp "$2" "$1"; fi
}
npy_zeros() { # npy_zeros FILE 'SHAPE' COUNT: float32 zeros of that shape (a 128-byte header)
  printf '\x93NUMPY\x01\x00\x76\x00%-117s\n' "{'descr': '<f4', 'fortran_order': False, 'shape': ($2), }" >"$1"
  head -c $((4 * $3)) /dev/zero >>"$1"
}
D=$G/sdpa_plain D2=$G/sdpa_bwd_additive
# the cases' inputs are copies in $T/in of the originals in $T/orig
mkdir -p "$T/in" "$T/orig"
cp $D/q.npy $D/k.npy $D/v.npy $G/mha_seed/params.safetensors $G/mha_seed/x.npy $G/mha_seed/out.npy \
  $D2/mask.npy $D2/G.npy $G/mha_seed/weights.npy "$T/sinks.npy" "$T/orig/"
printf 'the\ncat\nsat\non\nthe\nmat\nnow\n' >"$T/orig/tok7.txt"
cp "$T"/orig/* "$T/in/"
intact() { # every input is as it was (and is put back, so that one failure stays one)
  local f; for f in "$T"/orig/*; do
    if cmp -s "$f" "$T/in/${f##*/}"; then ok; else bad "the input ${f##*/} changed"; cp "$f" "$T/in/"; fi
  done
}
IQKV="--q $T/in/q.npy --k $T/in/k.npy --v $T/in/v.npy"
# an output that names an input is refused before anything runs, however it is spelt
expect 2 "" -- sdpa $IQKV --out "$T/in/q.npy" --weights-out "$T/no/such/dir/w.npy"
intact
expect 2 "" -- sdpa $IQKV --out "$T/in/q.npy"
intact
expect 2 "" -- sdpa $IQKV --out "$T/in/../in/k.npy"
intact
ln -sf q.npy "$T/in/qlink.npy"
expect 2 "" -- sdpa $IQKV --out "$T/in/qlink.npy"
intact
ln -f "$T/in/k.npy" "$T/in/khard.npy"
expect 2 "" -- sdpa $IQKV --out "$T/in/khard.npy"
intact
expect 2 "" -- sdpa $IQKV --out "$T/never_o.npy" --weights-out "$T/in/v.npy"
intact
AQKV="--q $D2/q.npy --k $D2/k.npy --v $D2/v.npy"
expect 2 "" -- sdpa $AQKV --out "$T/never_o.npy" --grad-out "$T/in/G.npy" --dq-out "$T/in/G.npy"
intact
expect 2 "" -- sdpa $AQKV --out "$T/never_o.npy" --grad-out "$T/in/G.npy" --mask "$T/in/mask.npy" --mask-grad-out "$T/in/mask.npy"
intact
expect 2 "" -- sdpa $IQKV --out "$T/never_o.npy" --sinks "$T/in/sinks.npy" --grad-out "$T/in/q.npy" --sinks-grad-out "$T/in/sinks.npy"
intact
MI="--params $T/in/params.safetensors --heads 2 --query $T/in/x.npy"
expect 2 "" -- mha $MI --out "$T/never_o.npy" --grad-out "$T/in/out.npy" --grads-out "$T/in/params.safetensors"
intact
expect 2 "" -- mha $MI --out "$T/in/x.npy"
intact
expect 2 "" -- mha $MI --out "$T/never_o.npy" --weights-out "$T/in/out.npy" --grad-out "$T/in/out.npy" --grads-out "$T/never_g.safetensors"
intact
if [ "$HAVE_PNG" = 1 ]; then
  expect 2 "" -- map --weights "$T/in/weights.npy" --png "$T/in/tok7.txt" --tokens "$T/in/tok7.txt"
  intact
  expect 2 "" -- map --weights "$T/in/weights.npy" --png "$T/in/weights.npy"
  intact
  expect 2 "" -- map $MI --png "$T/in/params.safetensors"
  intact
  expect 2 "" -- map $MI --png "$T/in/x.npy"
  intact
fi
# two outputs naming one file, a directory, something not a regular file: refused
expect 2 "" -- sdpa $IQKV --out "$T/never_o.npy" --weights-out "$T/./never_o.npy"
expect 2 "" -- sdpa $IQKV --out "$T/in"
mkfifo "$T/fifo"   # (not /dev/null: a tool that replaced it, run as root, would break the machine)
expect 2 "" -- sdpa $IQKV --out "$T/fifo"
if [ -p "$T/fifo" ]; then ok; else bad "an output replaced a FIFO"; fi
# a later output that fails leaves the earlier ones' files as they were, and no temporary
# (a file size limit makes the large --weights-out, written after --out, fail; the limit is 2 MiB
# and the large outputs 4 MiB or more, as ThreadSanitizer's runtime dies under a limit of 64 KiB)
npy_zeros "$T/in/q1.npy" '1, 1, 1, 4' 4
npy_zeros "$T/in/kbig.npy" '1, 1, 1000000, 4' 4000000
fsize_limited() { (trap '' XFSZ; ulimit -f 2048; exec "$@"); }
cp $D/k.npy "$T/precious.npy"
cp $D/v.npy "$T/precious_dq.npy"
ZQKV="--q $T/in/q1.npy --k $T/in/kbig.npy --v $T/in/kbig.npy"
WRAP=(fsize_limited)
expect 1 "" -- sdpa $ZQKV --out "$T/precious.npy" --weights-out "$T/never_w.npy"
same "$T/precious.npy" $D/k.npy
expect 1 "" -- sdpa $ZQKV --out "$T/precious.npy" --grad-out "$T/in/q1.npy" --dq-out "$T/precious_dq.npy" --dk-out "$T/never_dk.npy"
same "$T/precious.npy" $D/k.npy
same "$T/precious_dq.npy" $D/v.npy
WRAP=()
# a name the final rename would refuse (longer than NAME_MAX) fails before any output is in place
# (found by fuzz/fuzz_cli.c)
cp $D/k.npy "$T/precious2.npy"
expect 1 "" -- sdpa $IQKV --out "$T/precious2.npy" --weights-out "$T/never_$(printf 'n%.0s' $(seq 300))"
same "$T/precious2.npy" $D/k.npy
expect 1 "" -- sdpa $IQKV --out "$T/precious2.npy" --weights-out "$T/precious2.npy/w.npy"
same "$T/precious2.npy" $D/k.npy
# and the whole command succeeding replaces them
npy_zeros "$T/zeros.npy" '1, 1, 1, 4' 4
expect 0 "" -- sdpa $ZQKV --out "$T/precious.npy" --weights-out "$T/wbig.npy"
close "$T/precious.npy" "$T/zeros.npy" 0
# a symbolic link is followed: the file it points to is replaced, the link stays (a chain, a relative
# link in another directory, a dangling link)
mkdir -p "$T/sub"
cp $D/k.npy "$T/sub/target.npy"
ln -sf sub/target.npy "$T/l1.npy"
ln -sf ../l1.npy "$T/sub/l2.npy"
expect 0 "" -- sdpa $IQKV --out "$T/sub/l2.npy"
if [ -L "$T/sub/l2.npy" ] && [ -L "$T/l1.npy" ]; then ok; else bad "an output replaced a symbolic link"; fi
close "$T/sub/target.npy" $D/out.npy 1e-5
rm -f "$T/dangling_target.npy"
ln -sf dangling_target.npy "$T/dangling.npy"
expect 0 "" -- sdpa $IQKV --out "$T/dangling.npy"
if [ -L "$T/dangling.npy" ]; then ok; else bad "an output replaced a dangling link"; fi
close "$T/dangling_target.npy" $D/out.npy 1e-5
ln -sf no/such/dir/x.npy "$T/dangling_nodir.npy"
expect 1 "" -- sdpa $IQKV --out "$T/dangling_nodir.npy"
# a 250-byte file name (the temporaries must fit in NAME_MAX beside it)
L250=$(printf 'n%.0s' $(seq 246)).npy
expect 0 "" -- sdpa $IQKV --out "$T/$L250" --weights-out "$T/w_$L250"
close "$T/$L250" $D/out.npy 1e-5
close "$T/w_$L250" $D/weights.npy 1e-5
rm -f "$T/$L250" "$T/w_$L250"

# --- what an error echoes stays on one line: control characters escaped, long values cut ---
NL="$T/$(printf 'bad\nname\r\t\033[2J')"
expect 1 "" -- sdpa --q "$NL" --k $D/k.npy --v $D/v.npy --out "$T/never_o.npy"
# (the library's message already shows each control character of a path as '?'; the CLI escapes the rest)
if grep -qF 'bad?name???[2J' "$T/stderr"; then ok; else bad "control characters not replaced: $(cat -v "$T/stderr")"; fi
expect 1 "" -- mha --params "$NL" --heads 2 --query $G/mha_seed/x.npy --out "$T/never_o.npy"
expect 2 "" -- sdpa $IQKV --out "$T/never_o.npy" --mask "$T/in/q.npy" --mask-mode "$(printf 'a\nb')"
expect 2 "" -- sdpa $IQKV --out "$T/never_o.npy" "$(printf -- '--bo\ngus')"
expect 2 "" -- "$(printf 'sd\npa')"
LONG=$(printf 'x%.0s' $(seq 5000))
expect 2 "" -- sdpa $IQKV --out "$T/never_o.npy" --causal="$LONG"
if [ "$(wc -c <"$T/stderr")" -lt 400 ] && grep -q 'xxx\.\.\.' "$T/stderr"; then ok; else bad "a long value not cut: $(wc -c <"$T/stderr") bytes"; fi

# --- --scale: a subnormal is a number; one that float32 cannot hold is refused before anything is read ---
expect 0 "" -- sdpa $IQKV --out "$T/o_sub.npy" --scale 1e-320
close "$T/o_sub.npy" "$T/o_sub.npy" 0   # finite (a NaN or an Inf compares unequal to itself)
ATTN_KERNEL=ref "$ATTN" sdpa $IQKV --out "$T/o_sub_ref.npy" --scale 1e-320 && ok || bad "ref sdpa --scale 1e-320"
close "$T/o_sub.npy" "$T/o_sub_ref.npy" 1e-6
for s in 1e308 -1e39 4e38 inf nan 1e999; do
  expect 2 "" -- sdpa --q "$T/missing.npy" --k $D/k.npy --v $D/v.npy --out "$T/never_o.npy" --scale $s
done

# --- the benchmark's compute bound (a timeout catches its absence) ---
WRAP=(timeout 20)
expect 2 "" -- bench sdpa --batch 1 --heads 1 --seq 16777216 --dim 1
if grep -q 'GFLOP' "$T/stderr" && grep -q -- '--max-gflop' "$T/stderr"; then ok; else bad "bench's refusal: $(cat "$T/stderr")"; fi
expect 2 "" -- bench sdpa --batch 1 --heads 1 --seq 2097152 --dim 1 --backward --repeat 2
expect 2 "" -- bench mha --batch 1 --seq 1000000 --embed 16 --heads 1
expect 2 "" -- bench decode --batch 1 --kv-seq 262144 --heads 1024 --kv-heads 1 --dim 16 --seq 1024
WRAP=()
expect 2 "" -- bench sdpa --batch 1 --heads 1 --seq 64 --dim 8 --repeat 1 --backward --max-gflop 1e-3
expect 0 "" -- bench sdpa --batch 1 --heads 1 --seq 64 --dim 8 --repeat 1 --max-gflop 1e-3
expect 2 "" -- bench mha --batch 1 --seq 64 --embed 8 --heads 1 --repeat 1 --max-gflop 1e-5
expect 0 "" -- bench mha --batch 1 --seq 64 --embed 8 --heads 1 --repeat 1 --max-gflop 1e-3
for p in default fp32 bf16 f16; do
  expect 0 "" -- bench mha --batch 1 --seq 64 --embed 8 --heads 1 --repeat 1 --max-gflop 1e-3 --precision $p
  if grep -q "precision $p" "$T/stdout"; then ok; else bad "bench mha --precision $p: not reported: $(cat "$T/stdout")"; fi
done
expect 2 "" -- bench mha --batch 1 --seq 64 --embed 8 --heads 1 --repeat 1 --precision half
expect 2 "" -- bench sdpa --batch 1 --heads 1 --seq 64 --dim 8 --max-gflop 0

# --- --q-offset/--k-offset: rows far past every key see them all (causal = none); keys far ahead, none
D=$G/sdpa_plain SQKV="--q $D/q.npy --k $D/k.npy --v $D/v.npy"
expect 0 "" -- sdpa $SQKV --out "$T/off_none.npy"
expect 0 "" -- sdpa $SQKV --out "$T/off_far.npy" --causal --q-offset 100000
close "$T/off_far.npy" "$T/off_none.npy" 1e-6
expect 0 "" -- sdpa $SQKV --out "$T/off_ahead.npy" --causal --k-offset 100000
differ "$T/off_ahead.npy" "$T/off_none.npy"
expect 2 "$T/never_o.npy" -- sdpa $SQKV --out "$T/never_o.npy" --q-offset -1

# --- mpi-sdpa under mpirun (a build with MPI): the files attn sdpa writes, from every rank's shard ---
if command -v mpirun >/dev/null && ! OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$ATTN" mpi-sdpa 2>&1 | grep -q "without MPI"; then
  # under ASan, what Open MPI keeps until exit is not a leak of ours (tests/lsan_mpi.supp)
  M=(env ASAN_OPTIONS=detect_leaks=1:fast_unwind_on_malloc=0
     LSAN_OPTIONS=suppressions=$PWD/lsan_mpi.supp:fast_unwind_on_malloc=0 mpirun -np 2 --oversubscribe --quiet)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  D=$G/sdpa_causal_tl SQKV="--q $D/q.npy --k $D/k.npy --v $D/v.npy"
  expect 0 "" -- sdpa $SQKV --out "$T/m_ref.npy" --causal --window 5
  for s in ring zigzag ulysses auto; do
    if "${M[@]}" "$ATTN" mpi-sdpa $SQKV --out "$T/m_$s.npy" --causal --window 5 --strategy $s >"$T/stdout" 2>"$T/stderr"; then
      ok; close "$T/m_$s.npy" "$T/m_ref.npy" 1e-5
    else bad "mpi-sdpa --strategy $s: $(cat "$T/stderr")"; fi
  done
  # a rank that cannot read its shard: one 'attn: ' line from rank 0, exit 1, the old file kept
  echo keep >"$T/m_keep.npy"
  if "${M[@]}" "$ATTN" mpi-sdpa --q $D/q.npy --k $D/k.npy --v "$T/m_keep.npy" --out "$T/m_keep2.npy" >"$T/stdout" 2>"$T/stderr"; then
    bad "mpi-sdpa with a bad --v succeeded"
  elif [ "$(grep -c '^attn: ' "$T/stderr")" = 1 ] && [ ! -e "$T/m_keep2.npy" ]; then ok
  else bad "mpi-sdpa with a bad --v: $(cat "$T/stderr")"; fi
  if "${M[@]}" "$ATTN" mpi-sdpa $SQKV --out "$T/m_keep.npy" --strategy spiral >/dev/null 2>&1; then bad "--strategy spiral taken"
  elif [ "$(cat "$T/m_keep.npy")" = keep ]; then ok; else bad "a refused mpi-sdpa touched its --out"; fi
else
  echo "test_cli: mpi-sdpa not tested (no mpirun, or attn built without MPI)"
fi

# --- --help and -h: every command's usage on stdout, exit 0, whatever else is given ---
for c in sdpa mpi-sdpa mha map demo version bench "bench sdpa" "bench mha" "bench decode"; do
  for h in --help -h; do
    expect 0 "" -- $c $h
    if grep -q "attn $c" "$T/stdout" && [ ! -s "$T/stderr" ]; then ok; else bad "attn $c $h: no usage on stdout"; fi
  done
done
expect 0 "" -- sdpa --q "$T/missing.npy" --out "$T/never_o.npy" --help
missing "$T/never_o.npy"
expect 0 "" -- mha --bogus 1 -h
expect 0 "" -- bench sdpa --batch 1 --heads 1 --seq 16777216 --dim 1 --help
if grep -q "attn bench sdpa" "$T/stdout"; then ok; else bad "bench sdpa --help"; fi
expect 0 "" -- help mha
if grep -q "attn mha" "$T/stdout" && ! grep -q "attn sdpa" "$T/stdout"; then ok; else bad "attn help mha"; fi
expect 2 "" -- help frobnicate
expect 2 "" --

echo "test_cli: $pass passed, $fail failed"
[ "$fail" = 0 ]
