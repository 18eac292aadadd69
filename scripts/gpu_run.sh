#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the device machine: build (C++ tests, benchmark,
# Python wheel for sm_90), run every GPU test (GoogleTest + pytest), compute-sanitizer memcheck and
# racecheck over the GPU tests, then the transfer benchmarks. Logs under $OUT; a short table last.
#
# GoogleTest is not on the device image: the googletest source package travels as .deps/*.deb
# (see scripts/fetch_gpu_deps.sh) and is built here.
#
# usage: scripts/gpu_run.sh [test|bench|all|soak-start|soak-wait]
#   test, bench, all: build (incremental on a warm machine), then the tests and/or the benchmarks
#     (transfer, matmul interference, the Llama-3-8B-shaped demo).
#   soak-start: build the wheel, then start the 10-minute GPU soak detached (setsid) so that it
#     outlives this call; soak-wait, in the next call on the same warm machine, waits for it and
#     copies its log under $OUT. (One call may run 10 minutes at most.)
set -uo pipefail
phase=${1:-all}
OUT=${OUT:-$PWD/build/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
summary=()
run() {  # run NAME COMMAND...: log to $OUT/NAME.log, remember the outcome
  local name=$1; shift
  local t0=$(date +%s)
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s %-5s %4ss' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $(( $(date +%s) - t0 )))")
  tail -3 "$OUT/$name.log"
  return $rc
}

if [ "$phase" != soak-wait ]; then
gt=/tmp/gtest
if [ "$phase" != soak-start ] && [ ! -d $gt/install ]; then
  run gtest-build bash -c "mkdir -p $gt && dpkg -x .deps/googletest_*.deb $gt/src && \
    cmake -S $gt/src/usr/src/googletest -B $gt/build -G Ninja -DCMAKE_INSTALL_PREFIX=$gt/install \
      -DBUILD_GMOCK=OFF && cmake --build $gt/build && cmake --install $gt/build"
fi

[ "$phase" != soak-start ] && run build-cpp bash -c "cmake -S . -B build/gpu -G Ninja -DHICACHE_BUILD_TESTS=ON -DHICACHE_BUILD_BENCH=ON \
  -DHICACHE_BUILD_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGTest_DIR=$gt/install/lib/cmake/GTest && \
  cmake --build build/gpu"
run build-wheel python3 -m pip install -q --no-build-isolation --no-deps \
  --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 --config-settings=build-dir=build/gpu-wheel .
python3 -c "import hicache; print('cuda_available', hicache.cuda_available())" | tee "$OUT/cuda_available.txt"
fi

if [ "$phase" = test ] || [ "$phase" = all ]; then
run ctest bash -c "cd build/gpu && ctest --output-on-failure"
run example-gpu bash -c "cmake --install build/gpu --prefix build/gpu-install && \
  cmake -S examples/cpp -B build/gpu-example -G Ninja -DCMAKE_PREFIX_PATH=\$PWD/build/gpu-install \
    -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build/gpu-example && \
  build/gpu-example/example_engine --gpu && build/gpu-example/example_engine"
run lazy-pinning build/gpu/hicache_tests --gtest_filter="CudaCopier.LazyPinning*"
run pytest bash -c "cd tests/py && python3 -m pytest -q -rs -p no:cacheprovider ."
# The sanitizers serialize kernels, so tests that assert a kernel is still running cannot hold
# under them; every other GPU test runs under each tool.
san_filter='CudaCopier.*:-CudaCopier.InFlight*:CudaCopier.StagedLoadsQueued*:CudaCopier.PollRetires*:CudaCopier.StoresNeverWait*:CudaCopier.LazyPinning*'
run memcheck-cpp compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 build/gpu/hicache_tests --gtest_filter="$san_filter"
run racecheck-cpp compute-sanitizer --tool racecheck --error-exitcode 9 build/gpu/hicache_tests --gtest_filter="$san_filter"
run synccheck-cpp compute-sanitizer --tool synccheck --error-exitcode 9 build/gpu/hicache_tests --gtest_filter="$san_filter"
run initcheck-cpp compute-sanitizer --tool initcheck --error-exitcode 9 build/gpu/hicache_tests --gtest_filter="$san_filter"
grep -hE "SUMMARY|PASSED|FAILED" "$OUT"/*check-*.log > "$OUT/sanitizers.txt" 2>/dev/null
run memcheck-py bash -c "cd tests/py && compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -m pytest -q -p no:cacheprovider test_cuda.py -k 'not matmul'"
fi

if [ "$phase" = bench ] || [ "$phase" = all ]; then
run bench-transfer build/gpu/hicache_bench_transfer --pool-gib ${POOL_GIB:-32} --out "$OUT/bench_transfer.md"
run bench-matmul bash -c "for cb in 4 2 1; do python3 bench/transfer_matmul.py --cuda-blocks \$cb; echo; done"
cp "$OUT/bench-matmul.log" "$OUT/bench_matmul.md" 2>/dev/null
run demo-8b python3 -m hicache.cli demo --device cuda --model llama3-8b --conversations 2 --turns 4 \
  --first-tokens 8192 --user-tokens 6000 --new-tokens 4 --cache-pages 640
fi

soak_dir=/tmp/hicache-soak
if [ "$phase" = soak-start ]; then
  rm -rf $soak_dir && mkdir -p $soak_dir
  setsid bash -c "python3 bench/soak.py --minutes ${SOAK_MINUTES:-10} --device cuda \
    >$soak_dir/log 2>&1; echo \$? >$soak_dir/rc" </dev/null >/dev/null 2>&1 &
  sleep 30; echo "soak started; first 30 s:"; cat $soak_dir/log
fi
if [ "$phase" = soak-wait ]; then
  while [ ! -f $soak_dir/rc ]; do sleep 5; done
  cp $soak_dir/log "$OUT/soak_gpu.md"
  summary+=("$(printf '%-28s %-5s' soak-gpu "$([ "$(cat $soak_dir/rc)" = 0 ] && echo ok || echo FAIL)")")
  cat "$OUT/soak_gpu.md"
fi

echo; cat "$OUT/bench_transfer.md" 2>/dev/null; echo; cat "$OUT/bench_matmul.md" 2>/dev/null
echo; tail -25 "$OUT/demo-8b.log" 2>/dev/null
echo; printf '%s\n' "${summary[@]}"
