"""A GPU cache's host hit and store on torch's default stream against a stream of its own.

``try_resume`` without ``stream=`` loads on torch's current stream, which is the legacy default
stream (stream 0) unless the engine set another. ``cudaMemcpyBatchAsync`` refuses that stream;
before af7c1c7 the CUDA copier then copied DMA-path pages with its gather kernel
(0.61 of the link on an H100). ``store`` without ``stream=`` is the same case the other way.
This times a host hit of n page-major pages of 1 MiB (the DMA path) and a store of n new ones,
each from the call until the stream is done, on the default stream, on a stream of its own,
and on the default stream again, beside one contiguous copy of the same bytes each way
between pinned memory and the device (medians of 15). Needs a CUDA device.

    python bench/research/default_stream.py
"""

import os
import statistics
import time

import torch

import hicache

B = 16
print("HICACHE_CUDA_BATCH_DMA", os.environ.get("HICACHE_CUDA_BATCH_DMA"))
for n in (64, 256):
    page = 1 << 20
    src = torch.randint(0, 256, (n, page), dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n * page, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n * page, dtype=torch.uint8, device="cuda")
    c = hicache.HostPrefixCache(src, block_tokens=B, capacity_pages=n)
    # Stores of new prompts, each evicting the one before it (admitted at once: this measures
    # the copy, not the admission policy).
    w = hicache.HostPrefixCache(src, block_tokens=B, capacity_pages=n, admission="always")
    stored = 0
    prompt = torch.arange(n * B + 1, dtype=torch.int32)
    assert c.store("s", prompt, list(range(n))) == n
    torch.cuda.synchronize()
    c.poll()
    for name, st in (("default", None), ("own", torch.cuda.Stream()), ("default", None)):
        kw = {} if st is None else {"stream": st}
        hits = []
        for i in range(15):
            torch.cuda.synchronize()
            t = time.perf_counter()
            assert c.try_resume(f"r{i}", prompt, lambda k: list(range(k // B)), **kw) == n * B
            torch.cuda.synchronize()
            hits.append(time.perf_counter() - t)
            c.poll()
            c.forget(f"r{i}")
        stores = []
        for _ in range(15):
            stored += 1
            fresh = prompt + stored * 10_000_000
            torch.cuda.synchronize()
            t = time.perf_counter()
            assert w.store(f"w{stored}", fresh, list(range(n)), **kw) == n
            torch.cuda.synchronize()
            stores.append(time.perf_counter() - t)
            w.poll()
            w.forget(f"w{stored}")
        copies, copies_out = [], []
        for _ in range(15):
            t = time.perf_counter()
            dst.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t)
            t = time.perf_counter()
            pinned.copy_(dst, non_blocking=True)
            torch.cuda.synchronize()
            copies_out.append(time.perf_counter() - t)
        print(
            f"{n} x 1 MiB, {name} stream: host hit {statistics.median(hits) * 1e3:.2f} ms, "
            f"contiguous {statistics.median(copies) * 1e3:.2f} ms; "
            f"store {statistics.median(stores) * 1e3:.2f} ms, "
            f"contiguous {statistics.median(copies_out) * 1e3:.2f} ms",
            flush=True,
        )
