#!/usr/bin/env bash
# Installs a funcol build into a temporary prefix and builds a consumer against it, through
# find_package(funcol) and through pkg-config; both programs must run and print "ok". The
# consumer includes <Eigen/Core> itself: the package's flags must find it.
set -euo pipefail
build_dir=$1
consumer_src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
test -x "$work/prefix/bin/funcol" || { echo "bin/funcol was not installed"; exit 1; }
test -f "$work/prefix/include/funcol/funcol.h" || { echo "funcol.h was not installed"; exit 1; }

# find_package(funcol) -> funcol::funcol
cmake -S "$consumer_src" -B "$work/consumer-build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$work/consumer-build" >/dev/null
out=$("$work/consumer-build/consumer")
[ "$out" = "ok" ] || { echo "cmake consumer printed: $out"; exit 1; }

# pkg-config funcol
libdir=$(ls -d "$work/prefix"/lib*/pkgconfig | head -n 1)
flags=$(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs funcol)
# Libraries as -l flags: no path to one machine's file, least of all a versioned one.
for flag in $flags; do
  case $flag in
    -*) ;;
    *) echo "funcol.pc names a library file: $flag"; exit 1 ;;
  esac
done
# shellcheck disable=SC2086
g++ -O1 "$consumer_src/main.cc" -o "$work/consumer-pc" $flags -Wl,-rpath,"$(dirname "$libdir")"
out=$("$work/consumer-pc")
[ "$out" = "ok" ] || { echo "pkg-config consumer printed: $out"; exit 1; }
echo "install_consumer: find_package and pkg-config consumers built and ran"
