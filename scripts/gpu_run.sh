#!/usr/bin/env bash
# Everything that needs the GPU, on the device machine: build (C++ tests, benchmark, Python wheel
# for sm_90), the GPU tests (GoogleTest + pytest) and compute-sanitizer over them, the transfer
# and interference benchmarks, the Llama-3-8B-shaped demo, and the 10-minute GPU soak. Logs under
# $OUT; a short table last.
#
# usage: scripts/gpu_run.sh STEP...   (steps run in the order given)
#   build       gtest (from .deps, see scripts/fetch_gpu_deps.sh), C++ build, wheel; incremental
#   test        ctest, the example engine, pytest (less the long CPU-only suites)
#   test-cpu    those: the million-operation fuzz, the hostile-argument properties, the
#               differential runs (in a call of their own: the device tool allows 10 minutes)
#   sanitize    memcheck, racecheck, synccheck, initcheck over the GPU GoogleTests; memcheck over
#               the GPU pytest file
#   bench       bench/layouts.py (every layout through the Python API, default options), its
#               --cpu-cost mode, bench/research/small_pages.py (where a small-page call's time goes),
#               bench/call_cpu.py at 16- and 128-token pages (the null copier's calls)
#   matmul      bench/transfer_matmul.py (copies beside a bf16 matmul, every path, three rounds),
#               then the staged path's staging size and CTA count beside it (MATMUL_STAGED=0: not)
#   paths       bench/layouts.py with every copy path forced (each path's limit per layout)
#   engines     bench/layouts.py --engines: engines' own pools (16-64-token blocks), default
#               options, 16 MiB of staging, and the DMA path
#   mooncake    bench/tier_mooncake.py against a mooncake_master on 127.0.0.1 (the client's wheel
#               from .deps, see scripts/fetch_gpu_deps.sh): KV on the GPU, then on the CPU
#               ($MOONCAKE_DEVICES: which, default "cuda cpu"; $MOONCAKE_REPS: repetitions, 15)
#   mooncake-shapes  bench/research/mooncake_shapes.py --memory there: the raw client with
#               hicache's value shapes and host memory, one difference at a time; the NUMA layout
#               ($SHAPES: the pages and KiB of each shape, default "64 1024,32 8192";
#               $SHAPES_ARGS: the script's other arguments, default --memory)
#   staging     the layout grid at 1024 pages a call with 16 and with 64 MiB of staging, point
#               by point (the staging-window rule's A/B)
#   ab          $AB_CMD over two wheels in turn: this tree's and this tree with $AB_BASE's files
#               (as they were before a change) put back; AB_MOONCAKE=1 starts a mooncake_master
#               for it first ($where: bench/tier_mooncake.py's arguments to reach it)
#   store-sums  bench/research/store_sums.py: a GPU cache's store with the tier's page sums on the
#               device against the same store without them, one page to 1024 (what the sums cost
#               the store they run beside)
#   default-stream  bench/research/default_stream.py: a GPU cache's host hit and store on torch's
#               default (legacy) stream against a stream of its own, beside a contiguous copy
#   call-profile  bench/research/call_profile.py: the CUDA calls a store and a load of ~1000
#               small-block pages make, and how long the calls take to return
#   disk        bench/disk_tier.py on the device machine's local disk (write-back, read, one-page
#               hit beside a host hit, index rebuild), against a raw loop over the same directory
#   bench-lowlevel  the C++ transfer benchmark (copier against cudaMemcpy variants, pinning),
#               what submitting DMA pieces costs (bench/research/dma_submit.cu) and what each
#               CUDA call of a staging window costs (bench/research/window_calls.cu), what a DMA
#               piece costs by size and pinned memory (bench/research/piece_cost.cu), the
#               kernel path's own limit on small pages by CTAs and pages a launch
#               (bench/research/kernel_copy.cu), what the index costs a store into a cold pool
#               (bench/research/store_walk.cpp), where the CPU copier should start streaming
#               (bench/research/stream_threshold.cpp)
#   demo        hicache demo with a Llama-3-8B-shaped model, 8K-26K-token conversations
#   layerwise   bench/layerwise.py: convoys (a 1K-token load beside a 100K-token one) and the
#               load-or-recompute decision on a throttled link
#   agentic     hicache demo with the Llama-3-8B shape: the agentic workload (contexts of ~32K
#               tokens) without the cache, with it, and layer by layer; and 32K-token conversations
#   soak-start  start bench/soak.py --device cuda detached (setsid), so it outlives this call
#               (a call may run 10 minutes at most); later steps run beside it
#   soak-wait   wait for it (in a later call on the same warm machine) and keep its log
#   all         build test sanitize bench matmul demo
#
# The device tool brings back at most 8 files from $OUT: every log goes to $LOGS and is packed
# into $OUT/logs.tgz after each step (so a call cut off at its time limit still returns them);
# the benchmark tables are also copied to $OUT as they are written.
set -uo pipefail
OUT=${OUT:-$PWD/build/gpu-out}
LOGS=${LOGS:-/tmp/hicache-gpu-logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL=16
summary=()
run() {  # run NAME COMMAND...: log to $LOGS/NAME.log, remember the outcome
  local name=$1; shift
  local t0=$(date +%s)
  "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s %-7s %4ss' "$name" "$([ $rc = 0 ] && echo ok || echo FAIL:$rc)" $(( $(date +%s) - t0 )))")
  printf '%s\n' "${summary[@]}" >"$LOGS/summary.txt"
  tail -3 "$LOGS/$name.log"
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
  return $rc
}
gt=/tmp/gtest
# A mooncake_master on 127.0.0.1 at a random port (the client's wheel from .deps); $where holds
# the arguments bench/tier_mooncake.py takes to reach it.
start_master() {
  python3 -c "import mooncake.store" 2>/dev/null ||
    run mooncake-install python3 -m pip install -q --no-deps .deps/mooncake_transfer_engine_non_cuda-*.whl
  local master
  master=$(python3 -c "import mooncake, os; print(os.path.join(os.path.dirname(mooncake.__file__), 'mooncake_master'))")
  local rpc=$((20000 + RANDOM % 20000)); local http=$((rpc + 1))
  "$master" -rpc_address 127.0.0.1 -rpc_port $rpc -enable_http_metadata_server=true \
    -http_metadata_server_host 127.0.0.1 -http_metadata_server_port $http >"$LOGS/mooncake-master.log" 2>&1 &
  master_pid=$!; sleep 2
  export where="--master 127.0.0.1:$rpc --metadata http://127.0.0.1:$http/metadata"
}
stop_master() { kill $master_pid; wait $master_pid 2>/dev/null; }
soak_dir=/tmp/hicache-soak
steps=("$@")
[ ${#steps[@]} = 0 ] && steps=(all)
[ "${steps[*]}" = all ] && steps=(build test sanitize bench matmul demo)

for step in "${steps[@]}"; do
case $step in
build)
  if [ ! -d $gt/install ]; then
    run gtest-build bash -c "mkdir -p $gt && dpkg -x .deps/googletest_*.deb $gt/src && \
      cmake -S $gt/src/usr/src/googletest -B $gt/build -G Ninja -DCMAKE_INSTALL_PREFIX=$gt/install \
        -DBUILD_GMOCK=OFF && cmake --build $gt/build && cmake --install $gt/build"
  fi
  run build-cpp bash -c "cmake -S . -B build/gpu -G Ninja -DHICACHE_BUILD_TESTS=ON -DHICACHE_BUILD_BENCH=ON \
    -DHICACHE_BUILD_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGTest_DIR=$gt/install/lib/cmake/GTest && \
    cmake --build build/gpu"
  run build-wheel python3 -m pip install -q --no-build-isolation --no-deps \
    --config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90 --config-settings=build-dir=build/gpu-wheel .
  python3 -c "import hicache; print('cuda_available', hicache.cuda_available())"
  ;;
test)
  run ctest bash -c "cd build/gpu && ctest --output-on-failure"
  run example-gpu bash -c "cmake --install build/gpu --prefix build/gpu-install && \
    cmake -S examples/cpp -B build/gpu-example -G Ninja -DCMAKE_PREFIX_PATH=\$PWD/build/gpu-install \
      -DCMAKE_CUDA_ARCHITECTURES=90 && cmake --build build/gpu-example && \
    build/gpu-example/example_engine --gpu && build/gpu-example/example_engine"
  # The CPU-only suites whose length is their point (a million operations, every argument's
  # hostile values, the differential runs) run in `test-cpu`: with them, pytest outgrew the
  # device tool's 10-minute call on the H200 image of 2026-12-02 (CI runs them on every commit).
  run pytest bash -c "cd tests/py && python3 -m pytest -q -rs -p no:cacheprovider --durations=15 . \
    --ignore=test_fuzz_million.py --ignore=test_boundary_properties.py --ignore=test_differential.py"
  ;;
test-cpu)
  run pytest-cpu bash -c "cd tests/py && python3 -m pytest -q -rs -p no:cacheprovider --durations=15 \
    test_fuzz_million.py test_boundary_properties.py test_differential.py"
  ;;
sanitize)
  # The sanitizers serialize kernels, so tests that assert a kernel is still running cannot hold
  # under them; every other GPU test runs under each tool.
  # StagingThatCannotBeAllocated* provokes a failed cudaMalloc, which the tools report.
  f='CudaCopier.*:-CudaCopier.StagingThatCannotBeAllocated*:CudaCopier.InFlight*:CudaCopier.StagedLoadsQueued*:CudaCopier.PollRetires*:CudaCopier.StoresNeverWait*:CudaCopier.ThePoolIsPinned*'
  # initcheck does not see the writes of cudaMemcpyBatchAsync (see cpp/cuda/dma_batch.hpp): under
  # it the copier submits one cudaMemcpyAsync per piece.
  for tool in memcheck racecheck synccheck initcheck; do
    extra=; [ $tool = memcheck ] && extra="--leak-check full"
    HICACHE_CUDA_BATCH_DMA=$([ $tool = initcheck ] && echo 0 || echo 1) \
      run $tool-cpp compute-sanitizer --tool $tool $extra --error-exitcode 9 build/gpu/hicache_tests --gtest_filter="$f"
  done
  grep -HE "ERROR SUMMARY|PASSED|FAILED" "$LOGS"/*check-cpp.log > "$OUT/sanitizers.txt" 2>/dev/null
  # Host backtraces (the default) make the tool hold Python frames of CUDA calls, which keeps
  # caches alive past their last reference (nanobind then reports them leaked at exit, and
  # test_a_dropped_cuda_cache_is_freed_at_once fails only under the tool): device backtraces only.
  run memcheck-py bash -c "cd tests/py && compute-sanitizer --tool memcheck --show-backtrace device \
    --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider test_cuda.py -k 'not matmul'"
  ;;
bench)
  run bench-layouts python3 bench/layouts.py --pages 16,1024 --reps 3 --json "$OUT/layouts.json"
  cp "$LOGS/bench-layouts.log" "$OUT/bench_layouts.md"
  run bench-cpu-cost python3 bench/layouts.py --cpu-cost --reps 3
  cp "$LOGS/bench-cpu-cost.log" "$OUT/bench_cpu_cost.md"
  run bench-small-pages python3 bench/research/small_pages.py
  cp "$LOGS/bench-small-pages.log" "$OUT/bench_small_pages.md"
  # The null copier's calls on this host's CPU (BENCHMARKS.md, "CPU time of a call"): in logs.tgz.
  for b in 16 128; do run bench-call-cpu-$b python3 bench/call_cpu.py --block-tokens $b --reps 31; done
  ;;
matmul)
  # Every layout on every path, three rounds each (~7 minutes: a call of its own); then the
  # staged path on MLA's pool at 16 and 64 MiB of staging and at 32 and 132 CTAs, beside the
  # same copy staged with torch alone (what any staging costs the matmul).
  run bench-matmul python3 bench/transfer_matmul.py --paths auto,dma,staged,kernel --rounds 3
  cp "$LOGS/bench-matmul.log" "$OUT/bench_matmul.md"
  [ "${MATMUL_STAGED:-1}" = 1 ] && run bench-matmul-staged python3 bench/transfer_matmul.py \
    --paths staged --staging-mib 16,64 --cuda-blocks 4,132 --layouts "MLA, 61 x 144 KiB" --rounds 3 &&
    cp "$LOGS/bench-matmul-staged.log" "$OUT/bench_matmul_staged.md"
  ;;
engines)
  # Engines' own pools (16-, 32-, 64-token blocks of four model shapes): the default options,
  # the default path with 16 MiB of staging (the default before 2026-12-02), then every pool on
  # the DMA engines.
  run bench-engines python3 bench/layouts.py --engines --pages 1024 --reps 3 --json "$OUT/engines.json"
  run bench-engines-16 python3 bench/layouts.py --engines --pages 1024 --reps 3 --staging-mib 16 \
    --json "$OUT/engines_16.json"
  run bench-engines-dma python3 bench/layouts.py --engines --pages 1024 --reps 3 --paths dma \
    --json "$OUT/engines_dma.json"
  cat "$LOGS"/bench-engines*.log > "$OUT/bench_engines.md"
  ;;
paths)
  run bench-paths python3 bench/layouts.py --paths dma,staged,kernel --pages 1024 \
    --max-batch 536870912 --reps 2 --no-both --json "$OUT/paths.json"
  cp "$LOGS/bench-paths.log" "$OUT/bench_paths.md"
  ;;
mooncake|mooncake-shapes)
  start_master
  if [ $step = mooncake-shapes ]; then
    { lscpu | grep -i -E 'numa|socket|model name'; cat /sys/devices/system/node/node*/cpulist; } \
      >"$OUT/numa.txt" 2>&1
    IFS=, read -ra shapes <<<"${SHAPES:-64 1024,32 8192}"
    for shape in "${shapes[@]}"; do
      set -- $shape
      run bench-mooncake-shapes-$1x$2 python3 bench/research/mooncake_shapes.py $where --pages $1 \
        --page-kib $2 ${SHAPES_ARGS:---memory}
    done
    cat "$LOGS"/bench-mooncake-shapes-*.log | grep -v '^[IWE][0-9]' > "$OUT/bench_mooncake_shapes.md"
  else
    for dev in ${MOONCAKE_DEVICES:-cuda cpu}; do
      for shape in "64 1024" "256 1024" "32 8192"; do
        set -- $shape
        run bench-mooncake-$dev-$1x$2 python3 bench/tier_mooncake.py $where --pages $1 --page-kib $2 \
          --reps ${MOONCAKE_REPS:-15} --device $dev --phases
      done
    done
    for dev in ${MOONCAKE_DEVICES:-cuda cpu}; do cat "$LOGS"/bench-mooncake-$dev-*.log; done |
      grep -v '^[IWE][0-9]' > "$OUT/bench_mooncake.md"
  fi
  stop_master
  ;;
staging)
  run bench-staging python3 bench/layouts.py --pages 1024 --reps 3 --staging-mib 16,64 --json "$OUT/staging.json"
  cp "$LOGS/bench-staging.log" "$OUT/bench_staging.md"
  ;;
ab)
  # Two builds side by side in one run: this tree's wheel, and the wheel of this tree with the
  # files under $AB_BASE (the same relative paths, as they were before a change) put back; then
  # $AB_CMD on each in turn, base first, $AB_ROUNDS times (default 1). Logs ab-$AB_NAME-base-N
  # and ab-$AB_NAME-new-N. The wheels are built once a call: later ab steps of the same call
  # (other AB_NAME and AB_CMD) reuse them.
  : "${AB_BASE:?a directory of the files before the change}" "${AB_CMD:?the command to compare}"
  if ! ls /tmp/ab/new/*.whl /tmp/ab/base/*.whl >/dev/null 2>&1; then
    rm -rf /tmp/ab && mkdir -p /tmp/ab/new /tmp/ab/base /tmp/ab/tree
    cuda90=--config-settings=cmake.define.CMAKE_CUDA_ARCHITECTURES=90
    run ab-wheel-new python3 -m pip wheel -q --no-build-isolation --no-deps $cuda90 \
      --config-settings=build-dir=build/gpu-wheel -w /tmp/ab/new .
    tar --exclude=./build --exclude=./.deps -cf - . | tar -xf - -C /tmp/ab/tree
    cp -a "$AB_BASE"/. /tmp/ab/tree/
    run ab-wheel-base bash -c "cd /tmp/ab/tree && python3 -m pip wheel -q --no-build-isolation \
      --no-deps $cuda90 --config-settings=build-dir=/tmp/ab/tree-build -w /tmp/ab/base ."
  fi
  [ "${AB_MOONCAKE:-0}" = 1 ] && start_master  # AB_CMD reaches it through $where
  for r in $(seq ${AB_ROUNDS:-1}); do
    for v in base new; do
      python3 -m pip install -q --no-deps --force-reinstall /tmp/ab/$v/*.whl
      run ab-${AB_NAME:-cmd}-$v-$r bash -c "$AB_CMD"
    done
  done
  [ "${AB_MOONCAKE:-0}" = 1 ] && stop_master
  ;;
default-stream)
  run bench-default-stream python3 bench/research/default_stream.py
  cp "$LOGS/bench-default-stream.log" "$OUT/bench_default_stream.md"
  ;;
store-sums)
  run bench-store-sums python3 bench/research/store_sums.py --reps 11
  cp "$LOGS/bench-store-sums.log" "$OUT/bench_store_sums.md"
  ;;
call-profile)
  run bench-call-profile python3 bench/research/call_profile.py
  grep -v -E '^(STAGE|USDT|\[W)' "$LOGS/bench-call-profile.log" > "$OUT/bench_call_profile.md"
  ;;
disk)
  run bench-disk python3 bench/disk_tier.py --dir /tmp/hicache-disk-bench --total-mib 2048 --reps 3
  run bench-disk-16 python3 bench/disk_tier.py --dir /tmp/hicache-disk-bench --total-mib 2048 --reps 3 \
    --read-threads 16 --index-pages 0
  cat "$LOGS/bench-disk.log" "$LOGS/bench-disk-16.log" > "$OUT/bench_disk.md"
  rm -rf /tmp/hicache-disk-bench
  ;;
bench-lowlevel)
  run bench-transfer build/gpu/hicache_bench_transfer --pool-gib ${POOL_GIB:-32} --out "$OUT/bench_transfer.md"
  run bench-dma-submit build/gpu/hicache_bench_dma_submit
  cp "$LOGS/bench-dma-submit.log" "$OUT/bench_dma_submit.md"
  run bench-window-calls build/gpu/hicache_bench_window_calls
  cp "$LOGS/bench-window-calls.log" "$OUT/bench_window_calls.md"
  run bench-piece-cost build/gpu/hicache_bench_piece_cost
  cp "$LOGS/bench-piece-cost.log" "$OUT/bench_piece_cost.md"
  run bench-kernel-copy build/gpu/hicache_bench_kernel_copy
  cp "$LOGS/bench-kernel-copy.log" "$OUT/bench_kernel_copy.md"
  run bench-store-walk bash -c "for B in 16 128; do build/gpu/hicache_bench_store_walk --block-tokens \$B; done"
  cp "$LOGS/bench-store-walk.log" "$OUT/bench_store_walk.md"
  run bench-stream-threshold build/gpu/hicache_bench_stream_threshold
  cp "$LOGS/bench-stream-threshold.log" "$OUT/bench_stream_threshold.md"
  ;;
demo)
  # 2048-token prefill chunks: block-sized ones make the prefill so slow that the load hardly
  # shows in the TTFT (session 2 measured those: TTFT/ideal 1.001).
  run demo-8b python3 -m hicache.cli demo --device cuda --model llama3-8b --conversations 2 --turns 4 \
    --first-tokens 8192 --user-tokens 6000 --new-tokens 4 --cache-pages 640 --prefill-chunk 2048
  cp "$LOGS/demo-8b.log" "$OUT/demo_8b.md"
  ;;
layerwise)
  run bench-convoy python3 bench/layerwise.py convoy
  cp "$LOGS/bench-convoy.log" "$OUT/bench_convoy.md"
  run bench-decide python3 bench/layerwise.py decide
  cp "$LOGS/bench-decide.log" "$OUT/bench_decide.md"
  ;;
agentic)
  run demo-agentic python3 -m hicache.cli demo --device cuda --model llama3-8b --workload agentic \
    --layerwise --cache-pages 1200 --prefill-chunk 2048
  cp "$LOGS/demo-agentic.log" "$OUT/demo_agentic.md"
  run demo-32k python3 -m hicache.cli demo --device cuda --model llama3-8b --conversations 2 --turns 4 \
    --first-tokens 32768 --user-tokens 512 --new-tokens 4 --cache-pages 1200 --prefill-chunk 2048
  cp "$LOGS/demo-32k.log" "$OUT/demo_32k.md"
  ;;
soak-start)
  rm -rf $soak_dir && mkdir -p $soak_dir
  setsid bash -c "python3 bench/soak.py --minutes ${SOAK_MINUTES:-10} --device cuda \
    >$soak_dir/log 2>&1; echo \$? >$soak_dir/rc" </dev/null >/dev/null 2>&1 &
  sleep 15; echo "soak started; its first 15 s:"; cat $soak_dir/log
  ;;
soak-wait)
  t0=$(date +%s)
  if [ ! -f $soak_dir/log ]; then
    echo "no soak started on this machine (it went back after the last call?): run soak-start" >&2
    exit 2
  fi
  while [ ! -f $soak_dir/rc ]; do sleep 5; done
  cp $soak_dir/log "$OUT/soak_gpu.md"
  summary+=("$(printf '%-28s %-7s %4ss' soak-gpu "$([ "$(cat $soak_dir/rc)" = 0 ] && echo ok || echo FAIL)" $(( $(date +%s) - t0 )))")
  cat "$OUT/soak_gpu.md"
  ;;
*) echo "unknown step: $step" >&2; exit 2 ;;
esac
done

echo; cat "$OUT/sanitizers.txt" 2>/dev/null
echo; tail -5 "$OUT/bench_layouts.md" 2>/dev/null; echo; cat "$OUT/bench_cpu_cost.md" 2>/dev/null
echo; cat "$OUT/bench_matmul.md" 2>/dev/null; echo; cat "$OUT/bench_transfer.md" 2>/dev/null
echo; tail -22 "$OUT/demo_8b.md" 2>/dev/null
echo; printf '%s\n' "${summary[@]}"
