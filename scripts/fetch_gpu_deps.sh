#!/usr/bin/env bash
# The device machine has no package registry: fetch here what scripts/gpu_run.sh builds there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps
grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
(cd .deps && apt-get download googletest)
ls -la .deps
