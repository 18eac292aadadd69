// hicache._core: the nanobind module. All binding code lives here; the core knows nothing of it.
//
// Arrays arrive through DLPack (torch tensors, numpy arrays, anything with __dlpack__). Every
// buffer is validated here before the core sees it; arrays the core writes into are taken
// without conversion so nothing is ever written into a temporary copy.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <nanobind/trampoline.h>

#include <charconv>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hicache/hicache.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Tokens = nb::ndarray<const std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BlockIds = nb::ndarray<const std::int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// DLPack device types (dlpack.h): CPU, CUDA, CUDA pinned host memory.
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3;

template <typename... Ts>
hicache::Device device_of(const nb::ndarray<Ts...>& a, const std::string& what) {
  switch (a.device_type()) {
    case kDLCPU:
    case kDLCUDAHost:
      return {hicache::DeviceKind::kCpu, 0};
    case kDLCUDA:
      return {hicache::DeviceKind::kCuda, a.device_id()};
    default:
      throw std::invalid_argument(what + ": unsupported device type " +
                                  std::to_string(a.device_type()) + " (need CPU or CUDA memory)");
  }
}

// Bytes from one block to the next, requiring each block (dims 1..) to be C-contiguous.
hicache::Segment segment_of(const nb::ndarray<>& a, std::size_t index) {
  const std::string what = "segment " + std::to_string(index);
  if (a.ndim() < 1) throw std::invalid_argument(what + ": needs a block dimension (ndim >= 1)");
  if (a.shape(0) == 0)
    throw std::invalid_argument(what + " has no blocks (its first dimension is 0)");
  if (a.size() == 0)
    throw std::invalid_argument(what + ": its blocks hold no bytes (a dimension is 0)");
  std::int64_t expected = 1;
  for (std::size_t d = a.ndim(); d-- > 1;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) {
      throw std::invalid_argument(what + ": each block must be contiguous (dimension " +
                                  std::to_string(d) + " has stride " + std::to_string(a.stride(d)) +
                                  ", expected " + std::to_string(expected) + ")");
    }
    expected *= static_cast<std::int64_t>(a.shape(d));
  }
  if (a.stride(0) < expected) {
    throw std::invalid_argument(what + ": blocks overlap (stride " + std::to_string(a.stride(0)) +
                                " elements < block size " + std::to_string(expected) + ")");
  }
  const auto item = static_cast<std::int64_t>(a.itemsize());
  return {a.data(), static_cast<std::int64_t>(a.shape(0)), a.stride(0) * item, expected * item};
}

template <typename... Ts>
hicache::DeviceBuffer buffer_of(const nb::ndarray<Ts...>& a, const std::string& what) {
  std::int64_t expected = 1;
  for (std::size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride(d) != expected) {
      throw std::invalid_argument(what + " must be contiguous");
    }
    expected *= static_cast<std::int64_t>(a.shape(d));
  }
  return {const_cast<void*>(static_cast<const void*>(a.data())), a.nbytes(), device_of(a, what)};
}

hicache::EvictionPolicy parse_eviction(const std::string& eviction);

// "cpu" or "cuda:N": where a state-only cache's states live (no segment says it).
hicache::Device parse_device(const std::string& s) {
  if (s == "cpu") return {};
  if (s.rfind("cuda:", 0) == 0) {
    int index = -1;
    const char* first = s.data() + 5;
    const char* last = s.data() + s.size();
    const auto r = std::from_chars(first, last, index);
    if (r.ec == std::errc() && r.ptr == last && first != last && index >= 0) {
      return {hicache::DeviceKind::kCuda, index};
    }
  }
  throw std::invalid_argument("state_device must be 'cpu' or 'cuda:N', not '" + s + "'");
}

// The engine's tensors as segments, all on one device (named in the error if not). None: a
// state-only cache, on state_device.
std::pair<std::vector<hicache::Segment>, hicache::Device> segments_of(
    const std::vector<nb::ndarray<>>& segments, const std::string& state_device) {
  std::vector<hicache::Segment> segs;
  hicache::Device device{};
  if (segments.empty()) return {std::move(segs), parse_device(state_device)};
  for (std::size_t i = 0; i < segments.size(); ++i) {
    segs.push_back(segment_of(segments[i], i));
    const hicache::Device d = device_of(segments[i], "segment " + std::to_string(i));
    if (i == 0) {
      device = d;
    } else if (!(d == device)) {
      throw std::invalid_argument("segment " + std::to_string(i) + " is on " + d.str() +
                                  " but segment 0 is on " + device.str());
    }
  }
  return {std::move(segs), device};
}

// Owns the engine tensors for as long as the cache may copy to or from them. Members are
// destroyed in reverse order: the cache (which waits for transfers) before the tensors.
struct PyCache {
  std::vector<nb::ndarray<>> segments;
  nb::object prefill_seconds;  // the engine's callable, called by the cache (see make_cache)
  std::shared_ptr<hicache::DeferredCopier> deferred;
  std::unique_ptr<hicache::HostPrefixCache> cache;

  PyCache() = default;
  PyCache(PyCache&&) = default;
  // The cache's tier thread may be waiting for the GIL (a Tier written in Python): destroy the
  // cache, which joins that thread, without holding it.
  ~PyCache() {
    if (cache) {
      nb::gil_scoped_release release;
      cache.reset();
    }
  }
};

// The CUDA copier's options from their Python names, checked on every copier (a bad value is an
// error on the CPU too).
hicache::CudaCopierOptions cuda_options_of(int cuda_blocks, std::size_t cuda_staging_bytes,
                                           const std::string& cuda_path) {
  hicache::CudaCopierOptions o;
  o.max_blocks = cuda_blocks;
  o.staging_bytes = cuda_staging_bytes;
  if (cuda_path == "auto") {
    o.path = hicache::CopyPath::kAuto;
  } else if (cuda_path == "dma") {
    o.path = hicache::CopyPath::kDma;
  } else if (cuda_path == "staged") {
    o.path = hicache::CopyPath::kStaged;
  } else if (cuda_path == "kernel") {
    o.path = hicache::CopyPath::kKernel;
  } else {
    throw std::invalid_argument("cuda_path must be 'auto', 'dma', 'staged' or 'kernel', not '" +
                                cuda_path + "'");
  }
  o.validate();
  return o;
}

PyCache make_cache(std::vector<nb::ndarray<>> segments, std::int64_t block_tokens,
                   std::int64_t capacity_pages, std::int64_t keep_tokens,
                   std::vector<std::int64_t> state_parts, std::int64_t capacity_states,
                   std::int64_t state_lookback, nb::bytes salt, std::int64_t error_limit,
                   int key_bits, std::size_t pool_chunk_bytes, const std::string& copier,
                   int cuda_blocks, std::size_t cuda_staging_bytes, const std::string& cuda_path,
                   bool pin_upfront, const std::string& eviction, const std::string& admission,
                   std::shared_ptr<hicache::Tier> tier, hicache::TierOptions tier_options,
                   std::vector<std::int64_t> layer_segments, double prefill_tokens_per_s,
                   std::optional<nb::callable> prefill_seconds, const std::string& state_device) {
  PyCache out;
  auto [segs, device] = segments_of(segments, state_device);
  hicache::CacheConfig c;
  c.block_tokens = block_tokens;
  c.capacity_pages = capacity_pages;
  c.keep_tokens = keep_tokens;
  c.state_parts = std::move(state_parts);
  c.capacity_states = capacity_states;
  c.state_lookback = state_lookback;
  c.salt = std::string(salt.c_str(), salt.size());
  c.error_limit = error_limit;
  c.key_bits = key_bits;
  c.pool_chunk_bytes = pool_chunk_bytes;
  c.pin_upfront = pin_upfront;
  c.eviction = parse_eviction(eviction);
  c.admission = hicache::parse_admission(admission);
  c.tier = std::move(tier_options);
  c.layer_segments = std::move(layer_segments);
  if (prefill_seconds) {
    // The cache calls it from try_resume without the GIL; PyCache keeps the callable alive
    // (the function holds a borrowed pointer: copying an nb::object needs the GIL).
    out.prefill_seconds = *prefill_seconds;
    PyObject* fn = out.prefill_seconds.ptr();
    c.prefill_seconds = [fn](std::int64_t start, std::int64_t end) {
      nb::gil_scoped_acquire g;
      nb::object r = nb::borrow(fn)(start, end);
      double seconds = 0;
      if (!nb::try_cast(r, seconds) || !(seconds >= 0)) {
        throw std::invalid_argument("prefill_seconds(" + std::to_string(start) + ", " +
                                    std::to_string(end) + ") must return a number of seconds >= 0");
      }
      return seconds;
    };
  } else if (prefill_tokens_per_s > 0) {
    c.prefill_seconds = [prefill_tokens_per_s](std::int64_t start, std::int64_t end) {
      return static_cast<double>(end - start) / prefill_tokens_per_s;
    };
  }
  const hicache::CudaCopierOptions cuda_options =
      cuda_options_of(cuda_blocks, cuda_staging_bytes, cuda_path);
  std::shared_ptr<hicache::Copier> chosen;
  if (copier == "deferred") {
    out.deferred = std::make_shared<hicache::DeferredCopier>();
    chosen = out.deferred;
  } else if (copier == "null") {
    chosen = std::make_shared<hicache::NullCopier>();
  } else if (copier == "cpu") {
    chosen = std::make_shared<hicache::CpuCopier>();
  } else if (copier == "cuda") {
    if (device.kind != hicache::DeviceKind::kCuda) {
      throw std::invalid_argument("copier='cuda' needs CUDA segments");
    }
    chosen = hicache::make_cuda_copier(device.index, cuda_options);
  } else if (copier == "auto") {
    if (device.kind == hicache::DeviceKind::kCuda) {
      chosen = hicache::make_cuda_copier(device.index, cuda_options);
    }
  } else {
    throw std::invalid_argument(
        "copier must be 'auto', 'cpu', 'cuda', 'deferred' or 'null', not '" + copier + "'");
  }
  out.cache = std::make_unique<hicache::HostPrefixCache>(std::move(segs), device, c, chosen,
                                                         std::move(tier));
  out.segments = std::move(segments);
  return out;
}

hicache::EvictionPolicy parse_eviction(const std::string& eviction) {
  if (eviction == "lru") return hicache::EvictionPolicy::kLru;
  if (eviction == "leaf-first") return hicache::EvictionPolicy::kLeafFirst;
  throw std::invalid_argument("eviction must be 'leaf-first' or 'lru', not '" + eviction + "'");
}

// A Tier written in Python (hicache.Tier subclasses, e.g. the Mooncake Store backend). Called
// from hicache's tier thread and from engine threads without the GIL: each call takes it.
// Buffers cross as addresses (ints); the Python side reads and writes them in place.
struct PyTier final : hicache::Tier {
  NB_TRAMPOLINE(hicache::Tier);

  template <class... Args>
  nb::object call(const char* name, std::uint64_t hash, Args&&... args) const {
    nb::detail::ticket t(nb_trampoline, name, hash, true);
    return nb_trampoline.base().attr(t.key)(std::forward<Args>(args)...);
  }
  std::string name() const override {
    nb::gil_scoped_acquire g;
    return nb::cast<std::string>(call("name", nb::detail::str_hash("name")));
  }
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override {
    nb::gil_scoped_acquire g;
    std::vector<std::uintptr_t> addrs;
    for (const std::byte* v : values) addrs.push_back(reinterpret_cast<std::uintptr_t>(v));
    return nb::cast<std::int64_t>(call("put", nb::detail::str_hash("put"),
                                       std::vector<std::string>(names.begin(), names.end()), addrs,
                                       std::vector<std::size_t>(sizes.begin(), sizes.end())));
  }
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override {
    nb::gil_scoped_acquire g;
    std::vector<std::uintptr_t> addrs;
    for (std::byte* d : dests) addrs.push_back(reinterpret_cast<std::uintptr_t>(d));
    return nb::cast<std::int64_t>(call("get", nb::detail::str_hash("get"),
                                       std::vector<std::string>(names.begin(), names.end()), addrs,
                                       capacity));
  }
  std::int64_t exists(std::span<const std::string> names) override {
    nb::gil_scoped_acquire g;
    return nb::cast<std::int64_t>(call("exists", nb::detail::str_hash("exists"),
                                       std::vector<std::string>(names.begin(), names.end())));
  }
  std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) override {
    nb::gil_scoped_acquire g;
    return nb::cast<std::optional<std::vector<std::int64_t>>>(
        call("poll", nb::detail::str_hash("poll"), batch));
  }
  // Optional in Python: a Tier without its own wait() is polled.
  bool wait(std::int64_t batch, std::chrono::microseconds timeout) override {
    nb::gil_scoped_acquire g;
    nb::detail::ticket t(nb_trampoline, "wait", nb::detail::str_hash("wait"), false);
    if (!t.key.is_valid()) return false;
    return nb::cast<bool>(
        nb_trampoline.base().attr(t.key)(batch, std::chrono::duration<double>(timeout).count()));
  }
  void use_memory(std::span<std::byte> region) override {
    memory("use_memory", nb::detail::str_hash("use_memory"), region);
  }
  void release_memory(std::span<std::byte> region) override {
    memory("release_memory", nb::detail::str_hash("release_memory"), region);
  }
  // The memory hooks are optional in Python: the base class's own does nothing.
  void memory(const char* name, std::uint64_t hash, std::span<std::byte> region) {
    nb::gil_scoped_acquire g;
    nb::detail::ticket t(nb_trampoline, name, hash, false);
    if (!t.key.is_valid()) return;
    nb_trampoline.base().attr(t.key)(reinterpret_cast<std::uintptr_t>(region.data()),
                                     region.size());
  }
};

using U64s = nb::ndarray<const std::uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U32s = nb::ndarray<const std::uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::dict replay_dict(const hicache::ReplayResult& r) {
  nb::dict d;
  d["served_pages"] = r.served_pages;
  d["requests_hit"] = r.requests_hit;
  d["pages_stored"] = r.pages_stored;
  d["pages_declined"] = r.pages_declined;
  d["evictions"] = r.evictions;
  d["tier_pages"] = r.tier_pages;
  d["tier_pages_stored"] = r.tier_pages_stored;
  return d;
}

hicache::ReplayTrace replay_trace(const U64s& block_ids, const U32s& sub_pages,
                                  const BlockIds& offsets, const BlockIds& hit_limit) {
  return {{block_ids.data(), block_ids.shape(0)},
          {sub_pages.data(), sub_pages.shape(0)},
          {offsets.data(), offsets.shape(0)},
          {hit_limit.data(), hit_limit.shape(0)}};
}

nb::dict histogram_dict(const hicache::LatencyHistogram& h) {
  nb::dict d;
  d["bounds_us"] = std::vector<double>(h.kBoundsUs.begin(), h.kBoundsUs.end());
  d["counts"] = std::vector<std::int64_t>(h.counts.begin(), h.counts.end());
  d["sum_us"] = h.sum_us;
  return d;
}

hicache::Key key_of(const nb::bytes& b, const char* what) {
  if (b.size() != 16) {
    throw std::invalid_argument(std::string(what) + ": keys are 16 bytes (got " +
                                std::to_string(b.size()) + ")");
  }
  hicache::Key k;
  std::memcpy(k.bytes.data(), b.c_str(), 16);
  return k;
}

std::vector<hicache::Key> keys_of(const std::vector<nb::bytes>& v, const char* what) {
  std::vector<hicache::Key> out;
  out.reserve(v.size());
  for (const auto& b : v) out.push_back(key_of(b, what));
  return out;
}

std::vector<nb::bytes> bytes_of(const std::vector<hicache::Key>& keys) {
  std::vector<nb::bytes> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.emplace_back(k.bytes.data(), k.bytes.size());
  return out;
}

// A SlotMover with the engine tensors it copies to and from, kept alive as long as it is.
struct PyMover {
  std::vector<nb::ndarray<>> segments;
  std::unique_ptr<hicache::SlotMover> mover;
};

std::optional<std::string_view> salt_view(const std::optional<nb::bytes>& salt) {
  if (!salt) return std::nullopt;
  return std::string_view(salt->c_str(), salt->size());
}

std::int64_t try_resume(PyCache& self, std::string_view request_id, Tokens prompt,
                        nb::callable allocate, std::uintptr_t stream,
                        std::optional<std::vector<nb::ndarray<>>> state_out,
                        std::optional<nb::bytes> salt,
                        hicache::LayerwiseLoad* layerwise = nullptr) {
  std::optional<hicache::StateBuffers> out;
  if (state_out) {
    out.emplace();
    for (std::size_t i = 0; i < state_out->size(); ++i) {
      out->parts.push_back(buffer_of((*state_out)[i], state_out->size() == 1
                                                          ? std::string("state_out")
                                                          : "state_out part " + std::to_string(i)));
    }
  }
  hicache::HostPrefixCache::AllocateFn fn =
      [&allocate](std::int64_t tokens) -> std::optional<std::vector<std::int64_t>> {
    nb::gil_scoped_acquire acquire;
    nb::object r = allocate(tokens);
    if (r.is_none()) return std::nullopt;
    std::vector<std::int64_t> ids;
    if (!nb::try_cast(r, ids)) {
      throw nb::type_error("allocate must return a sequence of int block ids, or None to defer");
    }
    return ids;
  };
  const std::optional<std::string_view> chain_salt = salt_view(salt);
  nb::gil_scoped_release release;
  return self.cache->try_resume(request_id, {prompt.data(), prompt.shape(0)}, fn,
                                reinterpret_cast<hicache::StreamHandle>(stream), out, chain_salt,
                                layerwise);
}

std::int64_t store(PyCache& self, std::string_view request_id, Tokens tokens, BlockIds block_ids,
                   std::uintptr_t stream, std::optional<nb::callable> state_export,
                   std::optional<nb::bytes> salt) {
  // The arrays state_export returned, alive until we return (the GIL is held again then). The
  // ndarrays, not the capsules they came from: converting a DLPack capsule consumes it, and the
  // ndarray then owns the tensor, so a buffer kept only by its (renamed) capsule was freed when
  // the ndarray went out of scope, before the copy read it. An engine returning a fresh array
  // per position then had another thread's array copied in its place (issue 32).
  std::vector<nb::ndarray<nb::ro>> keep;
  hicache::HostPrefixCache::StateExportFn fn;
  if (state_export) {
    fn = [&state_export, &keep](std::int64_t pos) -> std::optional<hicache::StateBuffers> {
      nb::gil_scoped_acquire acquire;
      nb::object r = (*state_export)(pos);
      if (r.is_none()) return std::nullopt;
      std::vector<nb::ndarray<nb::ro>> arrays;  // only read from
      if (!nb::try_cast(r, arrays)) {
        throw nb::type_error(
            "state_export must return a list of arrays (DLPack tensors), one per state part, or "
            "None");
      }
      hicache::StateBuffers state;
      const std::string what = "state_export(" + std::to_string(pos) + ")";
      for (std::size_t i = 0; i < arrays.size(); ++i) {
        state.parts.push_back(
            buffer_of(arrays[i], arrays.size() == 1 ? what : what + " part " + std::to_string(i)));
      }
      for (auto& a : arrays) keep.push_back(std::move(a));
      return state;
    };
  }
  std::optional<std::string_view> chain_salt = salt_view(salt);
  std::int64_t n;
  {
    nb::gil_scoped_release release;
    n = self.cache->store(request_id, {tokens.data(), tokens.shape(0)},
                          {block_ids.data(), block_ids.shape(0)},
                          reinterpret_cast<hicache::StreamHandle>(stream), fn, chain_salt);
  }
  return n;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "hicache core (C++): host-memory KV prefix cache. Use the hicache package instead.";

  nb::exception<hicache::Error>(m, "CacheError");
  nb::exception<hicache::UnknownRequest>(m, "UnknownRequestError", PyExc_KeyError);

  m.def("cuda_available", &hicache::cuda_available,
        "Whether this build has the CUDA copier and a CUDA device is visible.");
  m.def("reclaim_shared_regions", &hicache::reclaim_shared_regions,
        "Remove every hicache region under /dev/shm whose creator is no longer running; returns "
        "their names.");
  m.def(
      "host_memory",
      []() -> std::optional<std::pair<std::size_t, std::size_t>> {
        const auto m = hicache::read_host_memory();
        if (!m) return std::nullopt;
        return std::make_pair(m->total, m->available);
      },
      "(MemTotal, MemAvailable) in bytes as the core reads them (what pools pinned in the "
      "background pace themselves by), or None where they cannot be read.");
  m.def(
      "chain_keys",
      [](nb::bytes salt, Tokens tokens, std::int64_t block_tokens, int key_bits) {
        const auto keys = hicache::chain_keys(std::string_view(salt.c_str(), salt.size()),
                                              {tokens.data(), tokens.shape(0)}, block_tokens,
                                              INT64_MAX, key_bits);
        std::vector<nb::bytes> out;
        for (const auto& k : keys) out.emplace_back(k.bytes.data(), k.bytes.size());
        return out;
      },
      "salt"_a, "tokens"_a.noconvert(), "block_tokens"_a, "key_bits"_a = 128,
      "16-byte chain keys of every full block of int32 `tokens`.");

  m.def(
      "replay_policy",
      [](U64s block_ids, U32s sub_pages, BlockIds offsets, BlockIds hit_limit,
         std::int64_t capacity_pages, const std::string& eviction, const std::string& admission) {
        const auto ev = parse_eviction(eviction);
        const auto ad = hicache::parse_admission(admission);
        hicache::ReplayResult r;
        {
          nb::gil_scoped_release release;
          r = hicache::replay_policy(replay_trace(block_ids, sub_pages, offsets, hit_limit),
                                     capacity_pages, ev, ad);
        }
        return replay_dict(r);
      },
      "block_ids"_a.noconvert(), "sub_pages"_a.noconvert(), "offsets"_a.noconvert(),
      "hit_limit"_a.noconvert(), "capacity_pages"_a, "eviction"_a, "admission"_a,
      "Replays a trace of pages through the index and admission policy (see trace_replay.hpp).");
  m.def(
      "replay_shared",
      [](U64s block_ids, U32s sub_pages, BlockIds offsets, BlockIds hit_limit,
         nb::ndarray<const std::int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> instance_of,
         std::int32_t instances, std::int64_t host_capacity_pages, std::int64_t tier_capacity_pages,
         const std::string& eviction, const std::string& admission, const std::string& write,
         const std::string& tier_model) {
        const auto ev = parse_eviction(eviction);
        const auto ad = hicache::parse_admission(admission);
        if (write != "through" && write != "back") {
          throw std::invalid_argument("tier write must be 'through' or 'back', not '" + write +
                                      "'");
        }
        const auto tw = write == "back" ? hicache::TierWrite::kBack : hicache::TierWrite::kThrough;
        if (tier_model != "lru" && tier_model != "disk") {
          throw std::invalid_argument("tier model must be 'lru' or 'disk', not '" + tier_model +
                                      "'");
        }
        const auto kind =
            tier_model == "disk" ? hicache::TierModelKind::kDisk : hicache::TierModelKind::kLru;
        hicache::ReplayResult r;
        {
          nb::gil_scoped_release release;
          r = hicache::replay_shared(replay_trace(block_ids, sub_pages, offsets, hit_limit),
                                     {instance_of.data(), instance_of.shape(0)}, instances,
                                     host_capacity_pages, tier_capacity_pages, ev, ad, tw, kind);
        }
        return replay_dict(r);
      },
      "block_ids"_a.noconvert(), "sub_pages"_a.noconvert(), "offsets"_a.noconvert(),
      "hit_limit"_a.noconvert(), "instance_of"_a.noconvert(), "instances"_a,
      "host_capacity_pages"_a, "tier_capacity_pages"_a, "eviction"_a, "admission"_a,
      "write"_a = "through", "tier_model"_a = "lru",
      "Several instances with private host pools over one shared tier (see trace_replay.hpp).");
  m.def(
      "replay_optimum",
      [](U64s block_ids, U32s sub_pages, BlockIds offsets, BlockIds hit_limit,
         std::int64_t capacity_pages) {
        hicache::ReplayResult r;
        {
          nb::gil_scoped_release release;
          r = hicache::replay_optimum(replay_trace(block_ids, sub_pages, offsets, hit_limit),
                                      capacity_pages);
        }
        return replay_dict(r);
      },
      "block_ids"_a.noconvert(), "sub_pages"_a.noconvert(), "offsets"_a.noconvert(),
      "hit_limit"_a.noconvert(), "capacity_pages"_a,
      "Belady's offline optimum over the same pages and hit rule.");

  nb::class_<hicache::BlockCatalog>(m, "BlockCatalog")
      .def(
          "__init__",
          [](hicache::BlockCatalog* self, std::int64_t capacity_slots, const std::string& eviction,
             const std::string& admission) {
            hicache::CatalogOptions o;
            o.capacity_slots = capacity_slots;
            o.eviction = parse_eviction(eviction);
            o.admission = hicache::parse_admission(admission);
            new (self) hicache::BlockCatalog(o);
          },
          "capacity_slots"_a, "eviction"_a, "admission"_a)
      .def(
          "lookup",
          [](hicache::BlockCatalog& c, nb::bytes key) {
            return static_cast<int>(c.lookup(key_of(key, "lookup")));
          },
          "key"_a, "0: miss, 1: hit (loadable), 2: pending (being stored)")
      .def(
          "prepare_load",
          [](hicache::BlockCatalog& c, const std::vector<nb::bytes>& keys) {
            return c.prepare_load(keys_of(keys, "prepare_load"));
          },
          "keys"_a)
      .def(
          "complete_load",
          [](hicache::BlockCatalog& c, const std::vector<nb::bytes>& keys) {
            c.complete_load(keys_of(keys, "complete_load"));
          },
          "keys"_a)
      .def(
          "touch",
          [](hicache::BlockCatalog& c, const std::vector<nb::bytes>& keys) {
            c.touch(keys_of(keys, "touch"));
          },
          "keys"_a)
      .def(
          "prepare_store",
          [](hicache::BlockCatalog& c, const std::vector<nb::bytes>& keys,
             std::optional<nb::bytes> parent) {
            std::optional<hicache::Key> p;
            if (parent) p = key_of(*parent, "prepare_store: parent");
            auto plan = c.prepare_store(keys_of(keys, "prepare_store"), p);
            return nb::make_tuple(plan.accepted, plan.slots, bytes_of(plan.evicted));
          },
          "keys"_a, "parent"_a.none(),
          "(indices of the keys accepted, their slots, keys evicted to make room)")
      .def(
          "complete_store",
          [](hicache::BlockCatalog& c, const std::vector<nb::bytes>& keys, bool success) {
            c.complete_store(keys_of(keys, "complete_store"), success);
          },
          "keys"_a, "success"_a)
      .def("take_events",
           [](hicache::BlockCatalog& c) {
             auto ev = c.take_events();
             return nb::make_tuple(bytes_of(ev.stored), bytes_of(ev.removed));
           })
      .def("clear", &hicache::BlockCatalog::clear)
      .def("stats", [](const hicache::BlockCatalog& c) {
        const auto s = c.stats();
        nb::dict d;
        d["lookups"] = s.lookups;
        d["lookup_hits"] = s.lookup_hits;
        d["blocks_loaded"] = s.blocks_loaded;
        d["blocks_offered"] = s.blocks_offered;
        d["blocks_stored"] = s.blocks_stored;
        d["blocks_declined"] = s.blocks_declined;
        d["blocks_no_room"] = s.blocks_no_room;
        d["stores_failed"] = s.stores_failed;
        d["evictions"] = s.evictions;
        d["used"] = s.used;
        d["pending"] = s.pending;
        d["capacity"] = s.capacity;
        d["admitting_second_sightings_only"] = s.admitting_second_sightings_only;
        return d;
      });

  nb::class_<PyMover>(m, "SlotMover")
      .def(
          "__init__",
          [](PyMover* self, std::vector<nb::ndarray<>> segments, std::int64_t num_slots,
             const std::string& copier, std::optional<std::string> shared_memory, bool create,
             std::size_t chunk_bytes, const std::string& cuda_path, int cuda_blocks,
             const std::string& owner, double attach_timeout_s) {
            if (segments.empty()) {
              throw std::invalid_argument("segments: at least one KV segment is required");
            }
            auto [segs, device] = segments_of(segments, "cpu");
            const hicache::CudaCopierOptions cuda_options =
                cuda_options_of(cuda_blocks, hicache::CudaCopierOptions{}.staging_bytes, cuda_path);
            std::shared_ptr<hicache::Copier> chosen;
            if (copier == "cpu") {
              chosen = std::make_shared<hicache::CpuCopier>();
            } else if (copier == "cuda" ||
                       (copier == "auto" && device.kind == hicache::DeviceKind::kCuda)) {
              chosen = hicache::make_cuda_copier(device.index, cuda_options);
            } else if (copier != "auto") {
              throw std::invalid_argument("copier must be 'auto', 'cpu' or 'cuda', not '" + copier +
                                          "'");
            }
            std::shared_ptr<hicache::HostAllocator> memory;
            if (shared_memory) {
              std::int64_t page = 0;
              for (const auto& seg : segs) page += seg.block_bytes;
              memory = hicache::make_shared_region_allocator(
                  {*shared_memory, create, owner,
                   "page_bytes=" + std::to_string(page) + " slots=" + std::to_string(num_slots),
                   attach_timeout_s});
            }
            new (self) PyMover{std::move(segments), std::make_unique<hicache::SlotMover>(
                                                        std::move(segs), device, num_slots, chosen,
                                                        memory, chunk_bytes)};
          },
          "segments"_a, "num_slots"_a, "copier"_a, "shared_memory"_a.none(), "create"_a,
          "chunk_bytes"_a, "cuda_path"_a = "auto",
          "cuda_blocks"_a = hicache::CudaCopierOptions{}.max_blocks, "owner"_a = "",
          "attach_timeout_s"_a = 60.0)
      .def(
          "submit",
          [](PyMover& self, bool to_host, BlockIds slots, BlockIds blocks, std::uintptr_t stream) {
            nb::gil_scoped_release release;
            return self.mover->submit(
                to_host ? hicache::Direction::kToHost : hicache::Direction::kToDevice,
                {slots.data(), slots.shape(0)}, {blocks.data(), blocks.shape(0)},
                reinterpret_cast<hicache::StreamHandle>(stream));
          },
          "to_host"_a, "slots"_a.noconvert(), "blocks"_a.noconvert(), "stream"_a)
      .def("finished",
           [](PyMover& self) {
             std::vector<std::pair<std::int64_t, bool>> out;
             for (const auto& r : self.mover->finished()) out.emplace_back(r.job, r.ok);
             return out;
           })
      .def(
          "wait",
          [](PyMover& self, const std::vector<std::int64_t>& jobs) { self.mover->wait(jobs); },
          "jobs"_a, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "slot_bytes",
          [](PyMover& self, std::int64_t slot) {
            if (slot < 0 || slot >= self.mover->num_slots()) {
              throw std::out_of_range("slot " + std::to_string(slot) + " is outside [0, " +
                                      std::to_string(self.mover->num_slots()) + ")");
            }
            const std::byte* p = self.mover->slot_address(slot);
            return nb::bytes(reinterpret_cast<const char*>(p), self.mover->layout().page_bytes());
          },
          "slot"_a, "Tests: a copy of the bytes in a host slot.")
      .def_prop_ro("page_bytes",
                   [](const PyMover& self) { return self.mover->layout().page_bytes(); })
      .def_prop_ro("num_slots", [](const PyMover& self) { return self.mover->num_slots(); })
      .def_prop_ro(
          "pinning",
          [](const PyMover& self) {
            const auto s = self.mover->pool().status();
            return std::make_tuple(std::string(hicache::HostPool::name(s.pinning)), s.note,
                                   s.allocated_bytes, s.total_bytes);
          },
          "(state, note, allocated bytes, total bytes) of the slots' memory (CacheStats.pinning)")
      .def_prop_ro("copy_path", [](const PyMover& self) { return self.mover->copy_path(); });

  nb::class_<hicache::Tier, PyTier>(m, "Tier",
                                    "A store shared by caches on several hosts (subclass it: "
                                    "name, put, get, exists, poll; optionally wait, use_memory)")
      .def(nb::init<>())
      .def("name", &hicache::Tier::name)
      .def(
          "put",
          [](hicache::Tier& t, std::vector<std::string> names, std::vector<std::uintptr_t> values,
             std::vector<std::size_t> sizes) {
            if (names.size() != values.size() || names.size() != sizes.size()) {
              throw std::invalid_argument("put: names, values and sizes differ in length");
            }
            std::vector<const std::byte*> v;
            for (auto a : values) v.push_back(reinterpret_cast<const std::byte*>(a));
            return t.put(names, v, sizes);
          },
          "names"_a, "values"_a, "sizes"_a,
          "Start writing values[i] (an address, sizes[i] bytes, readable until the batch "
          "completed) under names[i]; returns the batch. Results: bytes written, or below 0.")
      .def(
          "get",
          [](hicache::Tier& t, std::vector<std::string> names, std::vector<std::uintptr_t> dests,
             std::size_t capacity) {
            if (names.size() != dests.size()) {
              throw std::invalid_argument("get: names and dests differ in length");
            }
            std::vector<std::byte*> d;
            for (auto a : dests) d.push_back(reinterpret_cast<std::byte*>(a));
            return t.get(names, d, capacity);
          },
          "names"_a, "dests"_a, "capacity"_a,
          "Start reading names[i] into dests[i] (an address with room for `capacity` bytes); "
          "returns the batch. Results: bytes read, or below 0.")
      .def(
          "exists",
          [](hicache::Tier& t, std::vector<std::string> names) { return t.exists(names); },
          "names"_a)
      .def("poll", &hicache::Tier::poll, "batch"_a)
      .def(
          "wait", [](hicache::Tier&, std::int64_t, double) { return false; }, "batch"_a,
          "timeout_s"_a,
          "Block until the batch completed or timeout_s passed and return True; the default "
          "returns False at once and hicache polls instead. Called without the other calls' "
          "exclusion: it must only wait.")
      .def(
          "use_memory", [](hicache::Tier&, std::uintptr_t, std::size_t) {}, "addr"_a, "size"_a,
          "A region of host memory values are put from (the host pool, chunk by chunk: values "
          "go to the tier straight from host slots) or got into (the fetch buffer), before any "
          "put or get uses it: register it for zero-copy transfers. Does nothing unless "
          "overridden.")
      .def(
          "release_memory", [](hicache::Tier&, std::uintptr_t, std::size_t) {}, "addr"_a, "size"_a,
          "The cache is done with a region use_memory named (unregister it).");
  m.attr("TIER_MISSING") = hicache::Tier::kMissing;
  m.attr("TIER_FAILED") = hicache::Tier::kFailed;

  nb::class_<hicache::MemoryTier, hicache::Tier>(m, "MemoryTier",
                                                 "A Tier in this process's memory (tests)")
      .def(nb::init<>())
      .def("__len__", &hicache::MemoryTier::size)
      .def("names", &hicache::MemoryTier::names)
      .def("erase", &hicache::MemoryTier::erase, "name"_a)
      .def(
          "truncate",
          [](hicache::MemoryTier& t, const std::string& name, std::size_t bytes) {
            return t.edit(name,
                          [&](std::vector<std::byte>& v) { v.resize(std::min(v.size(), bytes)); });
          },
          "name"_a, "bytes"_a)
      .def(
          "value",
          [](hicache::MemoryTier& t, const std::string& name) {
            std::vector<std::byte> out;
            t.edit(name, [&](std::vector<std::byte>& v) { out = v; });
            return nb::bytes(reinterpret_cast<const char*>(out.data()), out.size());
          },
          "name"_a)
      .def(
          "set_value",
          [](hicache::MemoryTier& t, const std::string& name, nb::bytes value) {
            const auto* p = static_cast<const std::byte*>(value.data());
            return t.edit(name, [&](std::vector<std::byte>& v) { v.assign(p, p + value.size()); });
          },
          "name"_a, "value"_a)
      .def("fail_next", &hicache::MemoryTier::fail_next, "batches"_a);

  nb::class_<hicache::DiskTier, hicache::Tier>(
      m, "DiskTier", "A Tier in a local directory that outlives the process (docs/tier.md)")
      .def(
          "__init__",
          [](hicache::DiskTier* self, const std::string& path, std::int64_t capacity_bytes,
             std::int64_t segment_bytes, const std::string& direct_io, int read_threads) {
            hicache::DiskTierOptions o;
            o.path = path;
            o.capacity_bytes = capacity_bytes;
            o.segment_bytes = segment_bytes;
            o.direct_io = direct_io;
            o.read_threads = read_threads;
            nb::gil_scoped_release release;  // opening rebuilds the index: seconds, maybe
            new (self) hicache::DiskTier(std::move(o));
          },
          "path"_a, "capacity_bytes"_a, "segment_bytes"_a = 0, "direct_io"_a = "auto",
          "read_threads"_a = 8)
      .def(
          "wait",
          [](hicache::DiskTier& t, std::int64_t batch, double timeout_s) {
            return t.wait(batch, std::chrono::microseconds(
                                     static_cast<std::int64_t>(std::max(0.0, timeout_s) * 1e6)));
          },
          "batch"_a, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("path", [](const hicache::DiskTier& t) { return t.options().path; })
      .def_prop_ro("capacity_bytes",
                   [](const hicache::DiskTier& t) { return t.options().capacity_bytes; })
      .def("stats", [](const hicache::DiskTier& t) {
        const hicache::DiskTierStats s = t.stats();
        nb::dict d;
        d["values"] = s.values;
        d["bytes_on_disk"] = s.bytes_on_disk;
        d["segments"] = s.segments;
        d["values_written"] = s.values_written;
        d["values_rewritten"] = s.values_rewritten;
        d["values_written_direct"] = s.values_written_direct;
        d["values_read_direct"] = s.values_read_direct;
        d["values_read"] = s.values_read;
        d["segments_evicted"] = s.segments_evicted;
        d["write_failures"] = s.write_failures;
        d["read_failures"] = s.read_failures;
        d["damaged_entries"] = s.damaged_entries;
        d["index_rebuild_s"] = s.index_rebuild_s;
        d["index_files_used"] = s.index_files_used;
        d["segments_scanned"] = s.segments_scanned;
        d["direct_io"] = s.direct_io;
        d["read_only"] = s.read_only;
        d["last_error"] = s.last_error;
        return d;
      });

  nb::class_<hicache::PageStore>(
      m, "PageStore",
      "Pages named by an engine's own keys, gathered from pieces of its host pool, in a Tier "
      "as checked values (page_store.hpp; hicache.sglang uses it)")
      .def(
          "__init__",
          [](hicache::PageStore* self, std::shared_ptr<hicache::Tier> tier, std::string space,
             std::vector<std::size_t> piece_bytes, double timeout_s) {
            hicache::PageStoreOptions o;
            o.space = std::move(space);
            o.piece_bytes = std::move(piece_bytes);
            o.timeout = std::chrono::microseconds(static_cast<std::int64_t>(timeout_s * 1e6));
            new (self) hicache::PageStore(std::move(tier), std::move(o));
          },
          "tier"_a, "space"_a, "piece_bytes"_a, "timeout_s"_a = 30.0)
      .def(
          "put",
          [](hicache::PageStore& s, const std::vector<std::string>& keys,
             const std::optional<std::string>& first_parent,
             const std::vector<std::uintptr_t>& pieces) {
            const auto r = s.put(keys, first_parent, pieces);
            return std::vector<bool>(r.begin(), r.end());
          },
          "keys"_a, "first_parent"_a.none(), "pieces"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Writes each page (its pieces, page after page, in `pieces`); per page, whether the "
          "tier took it. keys[0]'s parent is `first_parent` (\"\" at a chain's start).")
      .def(
          "get",
          [](hicache::PageStore& s, const std::vector<std::string>& keys,
             const std::optional<std::string>& first_parent,
             const std::vector<std::uintptr_t>& pieces) {
            const auto r = s.get(keys, first_parent, pieces);
            return std::vector<bool>(r.begin(), r.end());
          },
          "keys"_a, "first_parent"_a.none(), "pieces"_a, nb::call_guard<nb::gil_scoped_release>(),
          "Reads each page into its pieces; per page, whether it was found and checked (a page "
          "that failed leaves its pieces undefined).")
      .def(
          "exists",
          [](hicache::PageStore& s, const std::vector<std::string>& keys) {
            const auto r = s.exists(keys);
            return std::vector<bool>(r.begin(), r.end());
          },
          "keys"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("value_name", &hicache::PageStore::value_name, "key"_a)
      .def_prop_ro("page_bytes", &hicache::PageStore::page_bytes)
      .def_prop_ro("pieces", &hicache::PageStore::pieces)
      .def("stats", [](const hicache::PageStore& s) {
        const hicache::PageStoreStats st = s.stats();
        nb::dict d;
        d["pages_put"] = st.pages_put;
        d["pages_put_failed"] = st.pages_put_failed;
        d["pages_got"] = st.pages_got;
        d["pages_missing"] = st.pages_missing;
        d["pages_rejected"] = st.pages_rejected;
        d["tier_errors"] = st.tier_errors;
        d["last_error"] = st.last_error;
        return d;
      });

  nb::class_<hicache::CacheStats>(m, "CacheStats")
      .def_ro("lookups", &hicache::CacheStats::lookups)
      .def_ro("lookup_tokens", &hicache::CacheStats::lookup_tokens)
      .def_ro("hits", &hicache::CacheStats::hits)
      .def_ro("hit_tokens", &hicache::CacheStats::hit_tokens)
      .def_ro("deferred", &hicache::CacheStats::deferred)
      .def_ro("hits_trimmed", &hicache::CacheStats::hits_trimmed)
      .def_ro("pages_recomputed", &hicache::CacheStats::pages_recomputed)
      .def_ro("layerwise_loads", &hicache::CacheStats::layerwise_loads)
      .def_ro("load_bytes_per_s", &hicache::CacheStats::load_bytes_per_s)
      .def_ro("stores", &hicache::CacheStats::stores)
      .def_ro("store_skips", &hicache::CacheStats::store_skips)
      .def_ro("store_skips_unpinned", &hicache::CacheStats::store_skips_unpinned)
      .def_ro("collisions", &hicache::CacheStats::collisions)
      .def_ro("pages_declined", &hicache::CacheStats::pages_declined)
      .def_ro("admitting_second_sightings_only",
              &hicache::CacheStats::admitting_second_sightings_only)
      .def_ro("pages_stored", &hicache::CacheStats::pages_stored)
      .def_ro("pages_discarded", &hicache::CacheStats::pages_discarded)
      .def_ro("pages_loaded", &hicache::CacheStats::pages_loaded)
      .def_ro("pages_evicted", &hicache::CacheStats::pages_evicted)
      .def_ro("states_stored", &hicache::CacheStats::states_stored)
      .def_ro("states_discarded", &hicache::CacheStats::states_discarded)
      .def_ro("states_loaded", &hicache::CacheStats::states_loaded)
      .def_ro("states_evicted", &hicache::CacheStats::states_evicted)
      .def_ro("transfers_in_flight", &hicache::CacheStats::transfers_in_flight)
      .def_ro("pages_used", &hicache::CacheStats::pages_used)
      .def_ro("pages_capacity", &hicache::CacheStats::pages_capacity)
      .def_ro("pages_busy", &hicache::CacheStats::pages_busy)
      .def_ro("states_used", &hicache::CacheStats::states_used)
      .def_ro("states_capacity", &hicache::CacheStats::states_capacity)
      .def_ro("states_busy", &hicache::CacheStats::states_busy)
      .def_ro("host_bytes", &hicache::CacheStats::host_bytes)
      .def_ro("host_bytes_capacity", &hicache::CacheStats::host_bytes_capacity)
      .def_ro("pinning", &hicache::CacheStats::pinning)
      .def_ro("pinning_note", &hicache::CacheStats::pinning_note)
      .def_ro("requests", &hicache::CacheStats::requests)
      .def_ro("salts", &hicache::CacheStats::salts)
      .def_prop_ro("load_latency",
                   [](const hicache::CacheStats& s) { return histogram_dict(s.load_latency); })
      .def_prop_ro("store_latency",
                   [](const hicache::CacheStats& s) { return histogram_dict(s.store_latency); })
      .def_ro("tier_pages_written", &hicache::CacheStats::tier_pages_written)
      .def_ro("tier_pages_dropped", &hicache::CacheStats::tier_pages_dropped)
      .def_ro("tier_pages_failed", &hicache::CacheStats::tier_pages_failed)
      .def_ro("tier_pages_queued", &hicache::CacheStats::tier_pages_queued)
      .def_ro("tier_pages_fetched", &hicache::CacheStats::tier_pages_fetched)
      .def_ro("tier_hit_tokens", &hicache::CacheStats::tier_hit_tokens)
      .def_ro("tier_pages_missing", &hicache::CacheStats::tier_pages_missing)
      .def_ro("tier_pages_rejected", &hicache::CacheStats::tier_pages_rejected)
      .def_ro("tier_fetches_late", &hicache::CacheStats::tier_fetches_late)
      .def_ro("tier_pages_checked_on_device", &hicache::CacheStats::tier_pages_checked_on_device)
      .def_ro("tier_errors", &hicache::CacheStats::tier_errors)
      .def_ro("tier_last_error", &hicache::CacheStats::tier_last_error)
      .def_ro("errors", &hicache::CacheStats::errors)
      .def_ro("disabled", &hicache::CacheStats::disabled)
      .def_ro("disabled_reason", &hicache::CacheStats::disabled_reason)
      .def_ro("last_error", &hicache::CacheStats::last_error)
      .def_prop_ro("hit_rate", &hicache::CacheStats::hit_rate)
      .def_prop_ro("token_hit_rate", &hicache::CacheStats::token_hit_rate);

  nb::class_<hicache::LayerwiseLoad>(m, "LayerwiseLoad")
      .def(nb::init<>())
      .def_prop_ro("tokens", &hicache::LayerwiseLoad::tokens)
      .def_prop_ro("layers", &hicache::LayerwiseLoad::layers)
      .def("ready", &hicache::LayerwiseLoad::ready, "layer"_a,
           nb::call_guard<nb::gil_scoped_release>())  // may submit copies under the cache's lock
      .def(
          "wait",
          [](const hicache::LayerwiseLoad& self, std::size_t layer, std::uintptr_t stream) {
            self.wait(layer, reinterpret_cast<hicache::StreamHandle>(stream));
          },
          "layer"_a, "stream"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("synchronize", &hicache::LayerwiseLoad::synchronize,
           nb::call_guard<nb::gil_scoped_release>());

  nb::class_<PyCache>(m, "HostPrefixCache")
      .def(
          "__init__",
          [](PyCache* self, std::vector<nb::ndarray<>> segments, std::int64_t block_tokens,
             std::int64_t capacity_pages, std::int64_t keep_tokens,
             std::vector<std::int64_t> state_parts, std::int64_t capacity_states,
             std::int64_t state_lookback, nb::bytes salt, std::int64_t error_limit, int key_bits,
             std::size_t pool_chunk_bytes, const std::string& copier, int cuda_blocks,
             std::size_t cuda_staging_bytes, const std::string& cuda_path, bool pin_upfront,
             const std::string& eviction, const std::string& admission,
             std::shared_ptr<hicache::Tier> tier, std::int64_t tier_wait_us,
             std::int64_t tier_queue_pages, std::int64_t tier_buffer_bytes, std::string tier_space,
             std::vector<std::int64_t> layer_segments, double prefill_tokens_per_s,
             std::optional<nb::callable> prefill_seconds, const std::string& state_device) {
            hicache::TierOptions tier_options;
            tier_options.wait_us = tier_wait_us;
            tier_options.queue_pages = tier_queue_pages;
            tier_options.buffer_bytes = tier_buffer_bytes;
            tier_options.space = std::move(tier_space);
            new (self) PyCache(
                make_cache(std::move(segments), block_tokens, capacity_pages, keep_tokens,
                           std::move(state_parts), capacity_states, state_lookback, salt,
                           error_limit, key_bits, pool_chunk_bytes, copier, cuda_blocks,
                           cuda_staging_bytes, cuda_path, pin_upfront, eviction, admission,
                           std::move(tier), std::move(tier_options), std::move(layer_segments),
                           prefill_tokens_per_s, std::move(prefill_seconds), state_device));
          },
          "segments"_a, "block_tokens"_a, "capacity_pages"_a, "keep_tokens"_a, "state_parts"_a,
          "capacity_states"_a, "state_lookback"_a, "salt"_a, "error_limit"_a, "key_bits"_a,
          "pool_chunk_bytes"_a, "copier"_a, "cuda_blocks"_a, "cuda_staging_bytes"_a, "cuda_path"_a,
          "pin_upfront"_a, "eviction"_a, "admission"_a, "tier"_a.none(), "tier_wait_us"_a,
          "tier_queue_pages"_a, "tier_buffer_bytes"_a, "tier_space"_a, "layer_segments"_a,
          "prefill_tokens_per_s"_a, "prefill_seconds"_a.none(), "state_device"_a = "cpu")
      .def("try_resume", &try_resume, "request_id"_a, "prompt"_a.noconvert(), "allocate"_a,
           "stream"_a, "state_out"_a.none(), "salt"_a.none(), "layerwise"_a.none() = nullptr)
      .def("store", &store, "request_id"_a, "tokens"_a.noconvert(), "block_ids"_a.noconvert(),
           "stream"_a, "state_export"_a.none(), "salt"_a.none())
      .def(
          "poll", [](PyCache& self) { return self.cache->poll(); },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "forget", [](PyCache& self, std::string_view id) { self.cache->forget(id); },
          "request_id"_a, nb::call_guard<nb::gil_scoped_release>())
      // Without the GIL, as every call that takes the cache's lock: a thread holding that lock may
      // wait for the GIL (a Python tier told about new pool memory, Tier.use_memory).
      .def(
          "stats", [](const PyCache& self) { return self.cache->stats(); },
          nb::call_guard<nb::gil_scoped_release>())
      .def(
          "prefetch",
          [](PyCache& self, Tokens prompt, std::optional<nb::bytes> salt) {
            const std::optional<std::string_view> chain_salt = salt_view(salt);
            nb::gil_scoped_release release;
            return self.cache->prefetch({prompt.data(), prompt.shape(0)}, chain_salt);
          },
          "prompt"_a.noconvert(), "salt"_a.none())
      .def(
          "flush_tier",
          [](PyCache& self, std::optional<double> timeout_s) {
            auto timeout = std::chrono::milliseconds::max();
            if (timeout_s) {
              if (!(*timeout_s >= 0) || *timeout_s > 1e9) {
                throw std::invalid_argument(
                    "flush_tier: timeout_s must be a number of seconds >= 0");
              }
              timeout = std::chrono::milliseconds(static_cast<std::int64_t>(*timeout_s * 1000));
            }
            return self.cache->flush_tier(timeout);
          },
          "timeout_s"_a.none() = nb::none(), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "tier_name",
          [](const PyCache& self, nb::bytes key) {
            return self.cache->tier_name(key_of(key, "tier_name"));
          },
          "key"_a)
      .def(
          "complete_transfers",
          [](PyCache& self, std::optional<std::uintptr_t> stream) -> std::size_t {
            if (!self.deferred) {
              throw std::invalid_argument("complete_transfers works only with copier='deferred'");
            }
            if (stream)
              return self.deferred->complete(reinterpret_cast<hicache::StreamHandle>(*stream));
            return self.deferred->complete();
          },
          "stream"_a.none() = nb::none())
      .def("page_lru_order",
           [](const PyCache& self) {
             std::vector<hicache::Key> keys;
             {
               nb::gil_scoped_release release;  // see stats
               keys = self.cache->page_lru_order();
             }
             std::vector<nb::bytes> out;
             for (const auto& k : keys) out.emplace_back(k.bytes.data(), 16);
             return out;
           })
      .def_prop_ro("page_bytes",
                   [](const PyCache& self) { return self.cache->layout().page_bytes(); })
      .def_prop_ro("copy_path", [](const PyCache& self) { return self.cache->copy_path(); })
      .def_prop_ro("num_blocks",
                   [](const PyCache& self) { return self.cache->layout().num_blocks(); })
      .def_prop_ro("device",
                   [](const PyCache& self) { return self.cache->layout().device().str(); });
}
