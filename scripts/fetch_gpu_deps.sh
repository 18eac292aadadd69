#!/usr/bin/env bash
# The device machine has no package registry: fetch here what scripts/gpu_run.sh builds there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
(cd .deps && apt-get download googletest)
# The Mooncake client for the device's Python 3.12 (gpu_run.sh mooncake), without its
# dependencies: the store's client does not import them.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 312 -d .deps \
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
ls -la .deps
