#!/usr/bin/env bash
# The version is written once, in CMakeLists.txt's project(); the Python
# package metadata must say the same, or a wheel would carry a second,
# drifting copy. Usage: test_version.sh CMAKE_PROJECT_VERSION PYPROJECT...
set -u
want=$1
shift
fails=0
for f in "$@"; do
  got=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$f" | head -1)
  if [ "$got" = "$want" ]; then
    echo "ok: $f says $got"
  else
    echo "FAIL: $f says version '${got}'; CMakeLists.txt's project() says $want"
    fails=$((fails + 1))
  fi
done
exit $((fails > 0))
