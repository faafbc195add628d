// Decode attention read straight from the paged KV cache, on CPU.
//
// The PyTorch path gathers every decoding request's blocks into one padded tensor, then runs
// SDPA over it: the cache is copied once per layer and step, and SDPA's kernel, tuned for many
// query rows, runs a few rows per KV head at a fraction of the memory bandwidth. Here each
// (request, KV head) task walks its block table in place: one pass scores every cached token
// against the query heads that share that KV head, a softmax, one pass sums the values.
// An 8-bit row is dequantized as it is read (its scale applied to each sum, not each value),
// so a quantized cache reads about a quarter of the bytes and writes none.
//
// Shapes: query [num_seqs, num_heads, head_dim] float32; k_cache / v_cache
// [num_blocks, block_size, num_kv_heads, row] with row = head_dim (float32) or
// head_dim + 2 (int8 / fp8 values, then a float16 scale); block_tables [num_seqs, max_blocks]
// and seq_lens [num_seqs] int64. Returns [num_seqs, num_heads, head_dim] float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // one AVX2 register of floats; head_dim is a multiple of it

// Lane-wise partial sums, so the compiler vectorizes without reordering any single sum.
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  return sum;
}

inline void add_scaled(float* acc, float weight, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += weight * x[i];
}

// A float32 cache row is read where it lies.
struct FloatRow {
  static const float* values(const uint8_t* row, int64_t /*head_dim*/, float* /*buffer*/) {
    return reinterpret_cast<const float*>(row);
  }
  static float scale(const uint8_t* /*row*/, int64_t /*head_dim*/) { return 1.f; }
};

// An 8-bit row: head_dim values of T, then a float16 scale, x_d = value_d * scale. The values
// are widened once into a small buffer that the query heads sharing the row then read; the
// scale moves out of the sums (q . x = scale * (q . values)).
template <typename T>
struct QuantizedRow {
  static const float* values(const uint8_t* row, int64_t head_dim, float* buffer) {
    const T* values = reinterpret_cast<const T*>(row);
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(values[d]);
    return buffer;
  }
  static float scale(const uint8_t* row, int64_t head_dim) {
    c10::Half scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return static_cast<float>(scale);
  }
};

template <typename Row>
void decode(const float* query, const uint8_t* k_cache, const uint8_t* v_cache, const int64_t* block_tables,
            const int64_t* seq_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, int64_t row_bytes, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t token_stride = num_kv_heads * row_bytes;
  const int64_t block_stride = block_size * token_stride;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row_buffer(head_dim), acc(group * head_dim), inv_sums(group);
    for (int64_t task = begin; task < end; ++task) {
      // head-major, so each thread's share of tasks spans short and long sequences alike
      const int64_t kv_head = task / num_seqs, seq = task % num_seqs;
      const int64_t len = seq_lens[seq];
      const int64_t* table = block_tables + seq * max_blocks;
      const float* q = query + (seq * num_heads + kv_head * group) * head_dim;  // [group, head_dim]
      auto row_of = [&](const uint8_t* cache, int64_t t) {
        return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
               kv_head * row_bytes;
      };
      scores.resize(group * len);  // [group, len]
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* row = row_of(k_cache, t);
        const float* k = Row::values(row, head_dim, row_buffer.data());
        const float k_scale = Row::scale(row, head_dim) * scale;
        for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot(q + g * head_dim, k, head_dim) * k_scale;
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        const float max_score = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - max_score));
        inv_sums[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const uint8_t* row = row_of(v_cache, t);
        const float* v = Row::values(row, head_dim, row_buffer.data());
        const float v_scale = Row::scale(row, head_dim);
        for (int64_t g = 0; g < group; ++g)
          add_scaled(acc.data() + g * head_dim, scores[g * len + t] * v_scale, v, head_dim);
      }
      float* o = out + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d) o[g * head_dim + d] = acc[g * head_dim + d] * inv_sums[g];
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 3, "query: [num_seqs, num_heads, head_dim] float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache and v_cache: contiguous [num_blocks, block_size, num_kv_heads, row], same shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens: int64");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(head_dim % kLanes == 0 && num_heads % num_kv_heads == 0, "head_dim % 8 and num_heads % num_kv_heads");
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(q);
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  auto run = [&](auto row_kind) {
    using Row = decltype(row_kind);
    decode<Row>(q.data_ptr<float>(), static_cast<const uint8_t*>(k_cache.data_ptr()),
                static_cast<const uint8_t*>(v_cache.data_ptr()), tables.data_ptr<int64_t>(),
                lens.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, head_dim,
                k_cache.size(1), row_bytes, tables.size(1), static_cast<float>(scale));
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(FloatRow{}); break;
    case at::kChar: run(QuantizedRow<int8_t>{}); break;
    case at::kFloat8_e4m3fn: run(QuantizedRow<c10::Float8_e4m3fn>{}); break;
    case at::kFloat8_e5m2: run(QuantizedRow<c10::Float8_e5m2>{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: no kernel for a ", k_cache.scalar_type(), " cache");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedllm, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
