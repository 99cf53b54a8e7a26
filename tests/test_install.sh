#!/usr/bin/env bash
# Installs the build into a fresh temporary prefix and builds a small program
# against the installed copy, as a user would:
#   1. pkg-config --cflags --libs attn (PKG_CONFIG_PATH into the prefix), shared;
#   2. pkg-config --static, the static archive (Libs.private brings OpenMP);
#   3. a CMake project: find_package(attn), targets attn::attn and attn::attn_static.
# Each program runs attention on a fixed input and checks the numbers. The
# prefix is not the one the build was configured with, so an attn.pc or a
# package file with a hard-coded prefix fails here.
# Usage: test_install.sh BUILD_DIR CMAKE C_COMPILER WORK_DIR VERSION (major.minor, what find_package asks for)
set -u
build=$1 cmake=$2 cc=$3 work=$4 version=$5
fails=0 skipped=0
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }

rm -rf "$work"
mkdir -p "$work/src"
prefix=$work/prefix
"$cmake" --install "$build" --prefix "$prefix" >"$work/install.log" 2>&1 || {
  cat "$work/install.log"
  echo "FAIL: cmake --install"
  exit 1
}
pc=$(find "$prefix" -name attn.pc | head -1)
[ -n "$pc" ] || { echo "FAIL: no attn.pc under $prefix"; exit 1; }
echo "installed; $pc:"
sed 's/^/  /' "$pc"

cat >"$work/src/main.c" <<'EOF'
/* attn_sdpa on one query over two keys, and the layer (its projections go
 * through the GEMM, or the CBLAS where the build uses one) with identity
 * weights on two tokens: each checked against the formula in double. */
#include <attn.h>
#include <math.h>
#include <stdio.h>

int main(void) {
  attn_ctx *ctx;
  if (attn_ctx_create(&ctx) != ATTN_OK) return 1;
  float q[2] = {1, 0}, k[4] = {1, 0, 0, 0}, v[4] = {1, 2, 3, 4}, out[2];
  const int64_t qs[4] = {1, 1, 1, 2}, ks[4] = {1, 1, 2, 2};
  attn_tensor tq = attn_tensor_view(q, ATTN_F32, 4, qs), tk = attn_tensor_view(k, ATTN_F32, 4, ks);
  attn_tensor tv = attn_tensor_view(v, ATTN_F32, 4, ks), to = attn_tensor_view(out, ATTN_F32, 4, qs);
  attn_status st = attn_sdpa(ctx, &to, NULL, NULL, &tq, &tk, &tv, NULL);
  /* logits 1/sqrt(2) and 0 */
  const double w0 = 1 / (1 + exp(-1 / sqrt(2.0))), want0 = w0 * 1 + (1 - w0) * 3, want1 = w0 * 2 + (1 - w0) * 4;
  int ok = st == ATTN_OK && fabs(out[0] - want0) < 1e-5 && fabs(out[1] - want1) < 1e-5;
  printf("libattn %s: sdpa out = %.6f %.6f (want %.6f %.6f) %s\n", attn_version_string(), out[0], out[1], want0,
         want1, ok ? "ok" : "WRONG");

  /* the layer, E = 2, one head, identity projections, no bias: self-attention of x */
  attn_mha_config cfg;
  attn_mha_config_init(&cfg, 2, 1);
  cfg.bias = 0;
  attn_mha *m = NULL;
  float x[4] = {1, 0, 0.5f, 2}, y[4];
  const int64_t xs[3] = {1, 2, 2};
  attn_tensor tx = attn_tensor_view(x, ATTN_F32, 3, xs), ty = attn_tensor_view(y, ATTN_F32, 3, xs);
  st = attn_mha_create(ctx, &m, &cfg);
  for (int p = ATTN_MHA_Q_WEIGHT; st == ATTN_OK && p <= ATTN_MHA_O_WEIGHT; p += 2) {
    attn_tensor w;
    st = attn_mha_param_view(ctx, &w, m, (attn_mha_param)p);
    if (st == ATTN_OK) ((float *)w.data)[0] = ((float *)w.data)[3] = 1;
  }
  if (st == ATTN_OK) st = attn_mha_forward(ctx, m, &ty, NULL, &tx, NULL, NULL, NULL);
  double worst = st == ATTN_OK ? 0 : INFINITY;
  for (int i = 0; st == ATTN_OK && i < 2; i++) {
    const double s0 = (x[2 * i] * x[0] + x[2 * i + 1] * x[1]) / sqrt(2.0);
    const double s1 = (x[2 * i] * x[2] + x[2 * i + 1] * x[3]) / sqrt(2.0);
    const double a = 1 / (1 + exp(s1 - s0));
    for (int c = 0; c < 2; c++) worst = fmax(worst, fabs(y[2 * i + c] - (a * x[c] + (1 - a) * x[2 + c])));
  }
  printf("mha: largest error %.3g %s\n", worst, worst < 1e-5 ? "ok" : "WRONG");
  ok = ok && worst < 1e-5;
  attn_mha_destroy(m);
  attn_ctx_destroy(ctx);
  return ok ? 0 : 1;
}
EOF

# ---- 1, 2: pkg-config --------------------------------------------------------------
if command -v pkg-config >/dev/null 2>&1; then
  export PKG_CONFIG_PATH
  PKG_CONFIG_PATH=$(dirname "$pc")
  cflags=$(pkg-config --cflags attn) && libs=$(pkg-config --libs attn) || bad "pkg-config cannot read attn.pc"
  libdir=$(pkg-config --variable=libdir attn)
  # the paths it gives must lead into this prefix
  if [ ! -f "$libdir/libattn.so" ] || [ ! -f "$(pkg-config --variable=includedir attn)/attn.h" ]; then
    bad "attn.pc points elsewhere: libdir=$libdir includedir=$(pkg-config --variable=includedir attn)"
  fi
  # shellcheck disable=SC2086 # pkg-config's output is a list of flags
  if "$cc" $cflags "$work/src/main.c" -o "$work/pc_shared" $libs -Wl,-rpath,"$libdir" -lm; then
    "$work/pc_shared" || bad "pkg-config, shared: the program failed"
    ldd "$work/pc_shared" 2>/dev/null | grep -q "$libdir/libattn.so" || bad "pkg-config, shared: not linked to $libdir/libattn.so"
  else
    bad "pkg-config, shared: compile or link failed: $cc $cflags main.c $libs"
  fi
  # static: the archive by name (-lattn alone would take the .so); Libs.private adds OpenMP
  slibs=$(pkg-config --static --libs attn | sed 's/-lattn\b/-l:libattn.a/')
  # shellcheck disable=SC2086
  if "$cc" -DATTN_STATIC $cflags "$work/src/main.c" -o "$work/pc_static" $slibs; then
    "$work/pc_static" || bad "pkg-config, static: the program failed"
    ! ldd "$work/pc_static" 2>/dev/null | grep -q libattn || bad "pkg-config, static: linked to a shared libattn"
  else
    bad "pkg-config, static: compile or link failed: $cc $cflags main.c $slibs"
  fi
  # libattn_mpi, where the build made it: attn_mpi.pc brings attn's and MPI's flags along
  if [ -n "$(find "$prefix" -name attn_mpi.pc | head -1)" ]; then
    cat >"$work/src/mpi_main.c" <<'EOF'
#include <attn_mpi.h>
int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int64_t rg[4];
  const int ok = attn_mpi_zigzag_range(10, 2, 1, rg) == ATTN_OK && rg[0] == 3 && rg[1] == 6 && rg[2] == 6 &&
                 rg[3] == 8 && attn_mpi_auto_strategy(4, 2, 0) == ATTN_MPI_ULYSSES;
  MPI_Finalize();
  return ok ? 0 : 1;
}
EOF
    mcflags=$(pkg-config --cflags attn_mpi) && mlibs=$(pkg-config --libs attn_mpi) || bad "pkg-config cannot read attn_mpi.pc"
    # shellcheck disable=SC2086
    if "$cc" $mcflags "$work/src/mpi_main.c" -o "$work/pc_mpi" $mlibs -Wl,-rpath,"$libdir"; then
      OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "$work/pc_mpi" || bad "pkg-config, attn_mpi: the program failed"
    else
      bad "pkg-config, attn_mpi: compile or link failed: $cc $mcflags mpi_main.c $mlibs"
    fi
  fi
else
  echo "pkg-config not found: the pkg-config half is skipped"
  skipped=1
fi

# ---- 3: CMake's find_package --------------------------------------------------------
cat >"$work/src/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.16)
project(attn_consumer LANGUAGES C)
find_package(attn VERSION_WANTED REQUIRED CONFIG)
add_executable(shared_user main.c)
target_link_libraries(shared_user PRIVATE attn::attn m)
add_executable(static_user main.c)
target_link_libraries(static_user PRIVATE attn::attn_static m)
EOF
sed -i "s/VERSION_WANTED/$version/" "$work/src/CMakeLists.txt"
if "$cmake" -S "$work/src" -B "$work/cmake_build" -DCMAKE_C_COMPILER="$cc" -DCMAKE_PREFIX_PATH="$prefix" \
     -DCMAKE_BUILD_TYPE=Release >"$work/cmake.log" 2>&1 &&
   "$cmake" --build "$work/cmake_build" >>"$work/cmake.log" 2>&1; then
  "$work/cmake_build/shared_user" || bad "find_package, attn::attn: the program failed"
  ldd "$work/cmake_build/shared_user" 2>/dev/null | grep -q "$prefix/.*libattn.so" ||
    bad "find_package, attn::attn: not linked to the installed libattn.so"
  "$work/cmake_build/static_user" || bad "find_package, attn::attn_static: the program failed"
else
  cat "$work/cmake.log"
  bad "find_package(attn): configure or build failed"
fi

if [ "$fails" -gt 0 ]; then
  echo "test_install: $fails failed"
  exit 1
fi
[ "$skipped" -eq 0 ] || exit 77
echo "test_install: ok"
