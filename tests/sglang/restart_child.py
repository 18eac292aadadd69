"""A separate SGLang process over the disk tier, for the restart and kill tests.

restart_child.py write OPTIONS OUT          backs up test_sglang_backend.TOKENS, writes the
                                            pages' CRC-32s to OUT, exits
restart_child.py write-forever OPTIONS LOG  backs up one new prompt after another, appending a
                                            line per prompt backed up, until killed
"""

from __future__ import annotations

import json
import sys
import zlib

from sglang_rig import backup, make_rig


def main() -> None:
    mode, options, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    rig = make_rig(extra=options)
    if mode == "write":
        _, written = backup(rig, list(range(1000, 1040)), seed=11)
        with open(out, "w") as f:
            json.dump([zlib.crc32(p) for p in written], f)
        rig.close()
        return
    seed = 0
    with open(out, "a") as log:
        while True:
            seed += 1
            tokens = [seed * 100_000 + t for t in range(64)]  # 16 pages, a prompt of its own
            _, written = backup(rig, tokens, seed=seed)
            log.write(
                json.dumps({"seed": seed, "tokens": tokens, "crc": [zlib.crc32(p) for p in written]}) + "\n"
            )
            log.flush()


if __name__ == "__main__":
    main()
