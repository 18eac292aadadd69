#pragma once
// Everything an engine needs: #include <hicache/hicache.hpp>.

#include "hicache/admission_policy.hpp"
#include "hicache/cache_config.hpp"
#include "hicache/cache_stats.hpp"
#include "hicache/copier.hpp"
#include "hicache/cpu_copier.hpp"
#include "hicache/cuda_copier.hpp"
#include "hicache/device.hpp"
#include "hicache/error.hpp"
#include "hicache/hash_chain.hpp"
#include "hicache/host_pool.hpp"
#include "hicache/host_prefix_cache.hpp"
#include "hicache/key.hpp"
#include "hicache/page_layout.hpp"
#include "hicache/prefix_index.hpp"
#include "hicache/trace_replay.hpp"
