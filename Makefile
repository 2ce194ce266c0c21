# The two commands of the README: `make demo` and `make test`. Everything else is a step of them.
# Build tree: build/ (the command lands at build/bin/funcol).

PRESET := $(if $(CI),ci,default)
JOBS ?= $(shell nproc)
PREFIX ?= $(CURDIR)/install
# ccache hits across clones (CI builds a fresh clone in another folder): paths relative to
# the checkout, and the build folder left out of the hash.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1
export CCACHE_MAXSIZE ?= 20G

CTEST := ctest --output-on-failure --no-tests=error -j$(JOBS)

.PHONY: all deps configure build test test-main test-clang test-asan test-tsan demo install clean

all: build

deps:
	@scripts/install-deps

configure: deps
	@cmake --preset $(PRESET) >/dev/null

build: configure
	@cmake --build build -j$(JOBS)

# Every test: the main build's ctest (unit, lit, end-to-end, install), every file of it
# through clang's front end, then the unit tests and the command's end-to-end tests under
# AddressSanitizer+UBSan and the threads backend under ThreadSanitizer.
test: test-main test-clang test-asan test-tsan

test-main: build
	cd build && $(CTEST)

# The build is g++'s; the libFuzzer build (test/fuzz) needs clang, which refuses some code g++
# accepts. Cached by ccache: seconds when nothing changed, about 4 minutes cold.
test-clang: build
	@scripts/clang-syntax-check build $(JOBS)

test-asan: deps
	@cmake --preset asan >/dev/null
	@cmake --build build-asan -j$(JOBS)
	cd build-asan && $(CTEST) -L unit
	# The funcol command as users run it, built with the sanitizers. Without leak checks: Open
	# MPI's ranks leave allocations of its unloaded components at exit, which LeakSanitizer
	# cannot attribute (the unit tests above check leaks).
	cd build-asan && ASAN_OPTIONS=detect_leaks=0 $(CTEST) -L e2e

test-tsan: deps
	@cmake --preset tsan >/dev/null
	@cmake --build build-tsan -j$(JOBS) --target tsan_tests
	cd build-tsan && TSAN_OPTIONS=halt_on_error=1 $(CTEST) -L tsan

# FSDP training of 32 small layers on 4 thread ranks (about 5 s): loss, reference check,
# collectives and step time with and without bucketing.
demo: build
	./build/bin/funcol train --ranks 4 --layers 32 --hidden 64 --batch 16 --steps 100 \
	  --optimizer adam --lr 0.001

install: build
	cmake --install build --prefix $(PREFIX)

clean:
	rm -rf build build-asan build-tsan install
