// How few_rows_linear and quant_linear cut a product's rows into blocks, each block a task per
// column group: blocks small enough that a prompt's activations stay in cache while every group
// passes over them (a 2,048-row step's activations for a K of 8,192 are 16-64 MiB; read once per
// group they came from memory each time), and, where a weight has fewer groups than about 4 per
// thread (a narrow weight on many cores), enough blocks to give every thread work.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagedllm_cpu {

// The activations one row block holds, as the kernel reads them
// (docs/benchmarks/vs_llama_cpp.md, "A prompt's rows in blocks").
constexpr int64_t kRowBlockBytes = 2 << 20;

// How many blocks `row_tiles` tiles of `tile_bytes` activation bytes each go in, over `groups`
// column groups and `threads` threads.
inline int64_t num_row_blocks(int64_t row_tiles, int64_t tile_bytes, int64_t groups, int64_t threads) {
  const int64_t cached_tiles = std::max<int64_t>(1, kRowBlockBytes / tile_bytes);
  const int64_t wanted_tasks = 4 * threads;
  const int64_t for_threads = groups >= wanted_tasks ? 1 : std::min(row_tiles, (wanted_tasks + groups - 1) / groups);
  return std::max((row_tiles + cached_tiles - 1) / cached_tiles, for_threads);
}

}  // namespace pagedllm_cpu
