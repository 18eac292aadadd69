"""SGLang compiles a C++ extension of its own at import (torch's JIT, named hicache_hash_cpp) into
~/.cache/torch_extensions by default: one directory for every checkout on the machine. Each
checkout gets its own under build/, so two runs at once (a developer's and CI's) never build
into, or load from, the same directory."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / "build" / "torch-extensions")
)
