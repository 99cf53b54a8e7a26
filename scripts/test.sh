#!/usr/bin/env bash
# The test command: builds with warnings as errors and runs the suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, with the optional CBLAS
# projections (where OpenBLAS is installed), then as released. Ends with
# ctest's summary.
#   scripts/test.sh          both builds
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
echo "== release build =="
run_suite build -DCMAKE_BUILD_TYPE=Release "${py[@]}"
