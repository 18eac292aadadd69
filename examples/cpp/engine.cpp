// A toy engine that embeds hicache the way a C++ serving engine would.
//
// It owns a paged, layer-major KV pool (one K and one V tensor per layer, first dimension = block
// id), serves multi-turn conversations (each turn's prompt = the previous prompt + answer + new
// user message), and around every prefill calls the cache exactly as a production scheduler:
//   try_resume -> allocate blocks -> prefill only the uncached suffix -> store -> poll -> forget.
// Its "model" writes KV that is a pure function of the token prefix, so the example can check
// that every page served from host memory equals what a recompute would have produced.
//
// usage: example_engine [--gpu] [--conversations N] [--turns N]
//   --gpu  KV pool in GPU memory (cudaMalloc) and copies on a CUDA stream (CUDA builds only)

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <hicache/hicache.hpp>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef EXAMPLE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

constexpr std::int64_t kBlockTokens = 128;
constexpr int kLayers = 4;
constexpr std::int64_t kBlockBytes = kBlockTokens * 8 * 64 * 2;  // 8 KV heads x 64 dims, fp16
constexpr std::int64_t kNumBlocks = 512;

// The engine's KV pool: 2 * kLayers segments of [kNumBlocks, kBlockBytes], in CPU or GPU memory.
class KvPool {
 public:
  explicit KvPool(bool gpu) : gpu_(gpu) {
    for (int s = 0; s < 2 * kLayers; ++s) {
      void* p = nullptr;
      const std::size_t bytes = kNumBlocks * kBlockBytes;
#ifdef EXAMPLE_WITH_CUDA
      if (gpu_ && cudaMalloc(&p, bytes) != cudaSuccess) throw std::runtime_error("cudaMalloc");
#endif
      if (!gpu_) p = new std::byte[bytes];
      segments_.push_back({p, kNumBlocks, kBlockBytes, kBlockBytes});
    }
  }
  ~KvPool() {
    for (auto& s : segments_) {
#ifdef EXAMPLE_WITH_CUDA
      if (gpu_) cudaFree(s.base);
#endif
      if (!gpu_) delete[] static_cast<std::byte*>(s.base);
    }
  }
  const std::vector<hicache::Segment>& segments() const { return segments_; }
  hicache::Device device() const {
    return gpu_ ? hicache::Device{hicache::DeviceKind::kCuda, 0} : hicache::Device{};
  }
  void write(int seg, std::int64_t block, const std::vector<std::uint8_t>& bytes) {
    char* dst = static_cast<char*>(segments_[seg].base) + block * kBlockBytes;
#ifdef EXAMPLE_WITH_CUDA
    if (gpu_) {
      cudaMemcpy(dst, bytes.data(), bytes.size(), cudaMemcpyHostToDevice);
      return;
    }
#endif
    std::memcpy(dst, bytes.data(), bytes.size());
  }
  std::vector<std::uint8_t> read(int seg, std::int64_t block) const {
    std::vector<std::uint8_t> out(kBlockBytes);
    const char* src = static_cast<const char*>(segments_[seg].base) + block * kBlockBytes;
#ifdef EXAMPLE_WITH_CUDA
    if (gpu_) {
      cudaMemcpy(out.data(), src, out.size(), cudaMemcpyDeviceToHost);
      return out;
    }
#endif
    std::memcpy(out.data(), src, out.size());
    return out;
  }

 private:
  bool gpu_;
  std::vector<hicache::Segment> segments_;
};

// The "model": a block's KV in segment `seg` is a function of the whole prefix up to the block.
std::vector<std::uint8_t> model_kv(const std::vector<std::int32_t>& prompt, std::int64_t block,
                                   int seg) {
  std::uint64_t h = 1469598103934665603ull + static_cast<std::uint64_t>(seg);
  for (std::int64_t i = 0; i < (block + 1) * kBlockTokens; ++i) {
    h = (h ^ static_cast<std::uint32_t>(prompt[static_cast<std::size_t>(i)])) * 1099511628211ull;
  }
  std::mt19937_64 rng(h);
  std::vector<std::uint8_t> kv(kBlockBytes);
  for (auto& b : kv) b = static_cast<std::uint8_t>(rng());
  return kv;
}

}  // namespace

int main(int argc, char** argv) {
  bool gpu = false;
  int conversations = 4, turns = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--gpu") {
      gpu = true;
    } else if (a == "--conversations" && i + 1 < argc) {
      conversations = std::atoi(argv[++i]);
    } else if (a == "--turns" && i + 1 < argc) {
      turns = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--gpu] [--conversations N] [--turns N]\n", argv[0]);
      return 2;
    }
  }
#ifndef EXAMPLE_WITH_CUDA
  if (gpu) {
    std::fprintf(stderr, "this hicache was built without CUDA: --gpu is not available\n");
    return 2;
  }
#endif
  if (gpu && !hicache::cuda_available()) {
    std::fprintf(stderr, "--gpu: no CUDA device\n");
    return 2;
  }

  KvPool pool(gpu);
  hicache::CacheConfig config;
  config.block_tokens = kBlockTokens;
  config.capacity_pages = 256;  // host memory: 256 pages of 8 layers x 128 KiB
  hicache::HostPrefixCache cache(pool.segments(), pool.device(), config);

  hicache::StreamHandle stream = nullptr;
#ifdef EXAMPLE_WITH_CUDA
  cudaStream_t cuda_stream = nullptr;
  if (gpu) {
    cudaStreamCreateWithFlags(&cuda_stream, cudaStreamNonBlocking);
    stream = cuda_stream;
  }
#endif

  std::vector<std::int64_t> free_blocks;
  for (std::int64_t b = kNumBlocks - 1; b >= 0; --b) free_blocks.push_back(b);
  std::mt19937 rng(7);
  auto random_tokens = [&](int n) {
    std::vector<std::int32_t> t(static_cast<std::size_t>(n));
    for (auto& x : t) x = static_cast<std::int32_t>(rng() % 32000);
    return t;
  };
  std::vector<std::vector<std::int32_t>> prompts;
  for (int c = 0; c < conversations; ++c) prompts.push_back(random_tokens(300 + 97 * c));

  std::printf("%-8s %8s %8s %8s %s\n", "request", "prompt", "cached", "computed", "check");
  std::int64_t total = 0, served = 0;
  int mismatches = 0;
  for (int t = 0; t < turns; ++t) {
    for (int c = 0; c < conversations; ++c) {
      auto& prompt = prompts[static_cast<std::size_t>(c)];
      const std::string id = "c" + std::to_string(c) + "t" + std::to_string(t);
      const auto n_blocks =
          static_cast<std::int64_t>((prompt.size() + kBlockTokens - 1) / kBlockTokens);
      std::vector<std::int64_t> table;  // the request's block table
      for (std::int64_t i = 0; i < n_blocks; ++i) {
        table.push_back(free_blocks.back());
        free_blocks.pop_back();
      }
      // 1. Resume: the cache asks for the blocks that receive the cached pages.
      const std::int64_t cached = cache.try_resume(
          id, prompt,
          [&](std::int64_t tokens) -> std::optional<std::vector<std::int64_t>> {
            return std::vector<std::int64_t>(table.begin(), table.begin() + tokens / kBlockTokens);
          },
          stream);
      const std::int64_t start = cached > 0 ? cached : 0;
#ifdef EXAMPLE_WITH_CUDA
      if (gpu) cudaStreamSynchronize(cuda_stream);  // a real engine enqueues prefill on `stream`
#endif
      // 2. Check what was served against a recompute, then prefill the rest.
      bool ok = true;
      for (std::int64_t b = 0; b < start / kBlockTokens; ++b) {
        for (int s = 0; s < 2 * kLayers; ++s) {
          ok &= pool.read(s, table[static_cast<std::size_t>(b)]) == model_kv(prompt, b, s);
        }
      }
      for (std::int64_t b = start / kBlockTokens;
           b < static_cast<std::int64_t>(prompt.size()) / kBlockTokens; ++b) {
        for (int s = 0; s < 2 * kLayers; ++s)
          pool.write(s, table[static_cast<std::size_t>(b)], model_kv(prompt, b, s));
      }
      mismatches += ok ? 0 : 1;
      // 3. Write-through, then retire finished copies and release the request.
      cache.store(id, prompt, table, stream);
#ifdef EXAMPLE_WITH_CUDA
      if (gpu) cudaStreamSynchronize(cuda_stream);  // the request's blocks are freed below
#endif
      cache.poll();
      cache.forget(id);
      for (std::int64_t b : table) free_blocks.push_back(b);
      std::printf("%-8s %8zu %8lld %8lld %s\n", id.c_str(), prompt.size(),
                  static_cast<long long>(start), static_cast<long long>(prompt.size()) - start,
                  ok ? "identical" : "MISMATCH");
      total += static_cast<std::int64_t>(prompt.size());
      served += start;
      // Next turn: the answer and a new user message extend the conversation.
      const auto answer = random_tokens(40 + static_cast<int>(rng() % 90));
      const auto user = random_tokens(20 + static_cast<int>(rng() % 200));
      prompt.insert(prompt.end(), answer.begin(), answer.end());
      prompt.insert(prompt.end(), user.begin(), user.end());
    }
  }
  const hicache::CacheStats s = cache.stats();
  std::printf("\n%s KV pool, %s copier\n", gpu ? "GPU" : "CPU", gpu ? "CUDA" : "CPU");
  std::printf("prompt tokens %lld, served from host memory %lld (%.1f %%)\n",
              static_cast<long long>(total), static_cast<long long>(served),
              100.0 * static_cast<double>(served) / static_cast<double>(total));
  std::printf(
      "lookups %lld, hits %lld, pages stored %lld, loaded %lld, evicted %lld, errors %lld\n",
      static_cast<long long>(s.lookups), static_cast<long long>(s.hits),
      static_cast<long long>(s.pages_stored), static_cast<long long>(s.pages_loaded),
      static_cast<long long>(s.pages_evicted), static_cast<long long>(s.errors));
  std::printf("every served page identical to a recompute: %s\n", mismatches == 0 ? "yes" : "NO");
#ifdef EXAMPLE_WITH_CUDA
  if (cuda_stream) cudaStreamDestroy(cuda_stream);
#endif
  return mismatches == 0 && s.hits > 0 ? 0 : 1;
}
