#!/usr/bin/env bash
# The test command: builds with warnings as errors and runs the suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, with the optional CBLAS
# projections (where OpenBLAS is installed), under ThreadSanitizer and the
# libFuzzer harnesses' smoke tests (where clang and its runtimes are
# installed: .ci/run installs them), then as released. Ends with ctest's
# summary of the release build.
#   scripts/test.sh          every build
#   scripts/test.sh quick    the release build only
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)

# The Python conformance suite (a ctest) needs a Python with numpy (and torch,
# else it is skipped): $ATTN_PYTHON, or the .venv that .ci/run makes.
py=()
if [ -n "${ATTN_PYTHON:-}" ]; then py=(-DATTN_PYTHON_EXECUTABLE="$ATTN_PYTHON")
elif [ -x .venv/bin/python ]; then py=(-DATTN_PYTHON_EXECUTABLE="$PWD/.venv/bin/python")
fi

run_suite() { # build dir, extra cmake flags...
  local dir=$1; shift
  # a build folder keeps the generator it was made with (the README's demo
  # command makes build/ with CMake's default one)
  local g=("${gen[@]}"); [ -f "$dir/CMakeCache.txt" ] && g=()
  cmake -S . -B "$dir" "${g[@]}" -DATTN_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
  # one test at a time: each already uses every core through OpenMP
  ctest --test-dir "$dir" --output-on-failure
}

if [ "${1:-}" != quick ]; then
  echo "== AddressSanitizer + UndefinedBehaviorSanitizer build =="
  ASAN_OPTIONS=detect_leaks=1 run_suite build-sanitize -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_SANITIZE=ON
fi
if [ "${1:-}" != quick ] && pkg-config --exists openblas 2>/dev/null; then
  echo "== release build with the optional CBLAS (OpenBLAS) projections =="
  run_suite build-cblas -DCMAKE_BUILD_TYPE=Release -DATTN_WITH_CBLAS=ON "${py[@]}"
fi

# The suites that need clang's runtimes: a probe program must compile and link.
probe_dir=$(mktemp -d)
trap 'rm -rf "$probe_dir"' EXIT
clang_links() { # clang_links FLAGS...: a small program (with an OpenMP loop, or a fuzz target) links
  command -v clang >/dev/null 2>&1 || return 1
  cat >"$probe_dir/p.c" <<'PROBE'
#include <stddef.h>
#include <stdint.h>
int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);
int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) {
  int s = 0;
#pragma omp parallel for reduction(+ : s)
  for (int i = 0; i < (int)n; i++) s += d[i];
  return s & 0;
}
#ifndef FUZZ
int main(void) { return LLVMFuzzerTestOneInput((const uint8_t *)"ab", 2); }
#endif
PROBE
  clang "$@" "$probe_dir/p.c" -o "$probe_dir/p" >/dev/null 2>&1
}
# Archer, libomp's ThreadSanitizer support, lives in LLVM's library folder.
archer_found() {
  local f; f=$(clang -print-file-name=libarcher.so 2>/dev/null) && [ -f "$f" ] && return 0
  f=$(clang -print-resource-dir 2>/dev/null)/../../libarcher.so && [ -f "$f" ]
}
if [ "${1:-}" != quick ]; then
  if ! command -v clang >/dev/null 2>&1; then
    tsan_why="clang is not installed"
  elif ! clang_links -fsanitize=thread -fopenmp; then
    tsan_why="clang cannot link -fsanitize=thread -fopenmp (ThreadSanitizer runtime or libomp missing)"
  elif ! archer_found; then
    tsan_why="libarcher.so (libomp's ThreadSanitizer support) not found"
  else
    tsan_why=""
  fi
  if [ -z "$tsan_why" ]; then
    echo "== ThreadSanitizer build (clang, libomp with Archer) =="
    run_suite build-tsan -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_TSAN=ON
  else
    echo "== ThreadSanitizer build: SKIPPED: $tsan_why (Debian: apt-get install clang libomp-dev libclang-rt-dev) =="
  fi

  if ! command -v clang >/dev/null 2>&1; then
    fuzz_why="clang is not installed"
  elif ! clang_links -DFUZZ -fsanitize=fuzzer,address,undefined -fopenmp; then
    fuzz_why="clang cannot link -fsanitize=fuzzer,address,undefined -fopenmp (libFuzzer or sanitizer runtime, or libomp, missing)"
  else
    fuzz_why=""
  fi
  if [ -z "$fuzz_why" ]; then
    echo "== libFuzzer harnesses, ${ATTN_FUZZ_SECONDS:-60} s each from their seeds (ASan + UBSan) =="
    g=("${gen[@]}"); [ -f build-fuzz/CMakeCache.txt ] && g=()
    cmake -S . -B build-fuzz "${g[@]}" -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTN_WERROR=ON \
      -DATTN_FUZZ=ON -DATTN_SANITIZE=ON -DATTN_BUILD_TESTS=OFF -DATTN_FUZZ_SECONDS="${ATTN_FUZZ_SECONDS:-60}" >/dev/null
    cmake --build build-fuzz -j "$jobs"
    # no harness (yet) is not a failure, but it is said
    listed=$(ctest --test-dir build-fuzz -N -L fuzz)
    if grep -q 'Total Tests: 0' <<<"$listed"; then
      echo "fuzz: no harness is registered in fuzz/CMakeLists.txt: nothing to run"
    fi
    ctest --test-dir build-fuzz -L fuzz --no-tests=ignore --output-on-failure
  else
    echo "== libFuzzer harnesses: SKIPPED: $fuzz_why (Debian: apt-get install clang libomp-dev libclang-rt-dev) =="
  fi
fi
echo "== release build =="
run_suite build -DCMAKE_BUILD_TYPE=Release "${py[@]}"
