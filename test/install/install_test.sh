#!/usr/bin/env bash
# Installs a funcol build into a temporary prefix and builds a consumer against it, through
# find_package(funcol) and through pkg-config; both programs must run and print "ok". The
# consumer includes <Eigen/Core> itself: the package's flags must find it. With gloo (third
# argument 1), the installed bin/funcol-gloo-launch runs the consumer as a 2-process job.
set -euo pipefail
build_dir=$1
consumer_src=$2
with_gloo=${3:-0}  # 1: the build has the gloo backend
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/funcol" || { echo "bin/funcol was not installed"; exit 1; }
test -f "$work/prefix/include/funcol/funcol.h" || { echo "funcol.h was not installed"; exit 1; }

# The exported targets name no file of this machine (libraries go by name), define none of the
# build's own macros, and need no header-only dependency of the build (CLI11, nlohmann_json):
# the consumer is configured with those packages hidden.
exported=$(cat "$work"/prefix/lib*/cmake/funcol/funcolTargets*.cmake)
for bad in '/usr/lib' 'FUNCOL_WITH_' 'CLI11' 'nlohmann'; do
  if grep -q "$bad" <<<"$exported"; then
    echo "the installed CMake package mentions $bad:"
    grep -n "$bad" "$work"/prefix/lib*/cmake/funcol/funcolTargets*.cmake
    exit 1
  fi
done

# find_package(funcol) -> funcol::funcol
cmake -S "$consumer_src" -B "$work/consumer-build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer-build" >/dev/null
out=$("$work/consumer-build/consumer")
[ "$out" = "ok" ] || { echo "cmake consumer printed: $out"; exit 1; }

# With gloo: the installed launcher starts the consumer's ranks as processes of one job.
if [ "$with_gloo" = 1 ]; then
  launch="$work/prefix/bin/funcol-gloo-launch"
  test -x "$launch" || { echo "bin/funcol-gloo-launch was not installed"; exit 1; }
  out=$(FUNCOL_TIMEOUT=60 "$launch" --np 2 --timeout 120 -- "$work/consumer-build/consumer" gloo)
  want=$'[rank 0] rank 0 of 2\n[rank 1] rank 1 of 2'
  [ "$out" = "$want" ] || { echo "funcol-gloo-launch of the consumer printed: $out"; exit 1; }
fi

# pkg-config funcol
libdir=$(ls -d "$work/prefix"/lib*/pkgconfig | head -n 1)
flags=$(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs funcol)
# Libraries as -l flags: no path to one machine's file, least of all a versioned one; and no
# -std, which, coming after the user's own, would lower a C++23 program to C++20.
for flag in $flags; do
  case $flag in
    -std=*) echo "funcol.pc sets the language standard: $flag"; exit 1 ;;
    -*) ;;
    *) echo "funcol.pc names a library file: $flag"; exit 1 ;;
  esac
done
for std in c++20 c++23; do
  # shellcheck disable=SC2086
  g++ -std=$std -O1 "$consumer_src/main.cc" -o "$work/consumer-pc" $flags \
    -Wl,-rpath,"$(dirname "$libdir")"
  out=$("$work/consumer-pc")
  [ "$out" = "ok" ] || { echo "pkg-config consumer (-std=$std) printed: $out"; exit 1; }
done
# An older standard gets one clear error first, not only the compiler's on C++20 constructs.
# shellcheck disable=SC2086
if out=$(g++ -std=c++17 -fsyntax-only "$consumer_src/main.cc" $flags 2>&1); then
  echo "the consumer compiled with -std=c++17"; exit 1
fi
first=$(echo "$out" | grep -m1 "error")
case $first in
  *"funcol needs C++20 or newer"*) ;;
  *) echo "under -std=c++17 the first error is not funcol's: $first"; exit 1 ;;
esac
echo "install_consumer: find_package and pkg-config consumers built and ran"
