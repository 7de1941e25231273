// Ragged paged attention over a float32 KV cache on x86-64 CPUs with AVX2 and FMA, as an XLA FFI handler.
//
//   maxtext_paged_attention: out[t, h] = softmax(scale * q[t, h] . K) V over the keys token t may see
//
// The pure-JAX attention gathers every page of a request's block table, padded to the table's length, and
// computes scores for all of those positions before masking them. This kernel reads, in place, only the cache rows
// of the keys a token attends to (its request's positions up to its own, within the sliding window), one token at a
// time: each key's row (all KV heads, contiguous in its page) once for the scores of every query head and once for
// the weighted sum of the values, with the softmax between. The cache holds this step's keys and values already
// (XLA writes them first).
//
// Inputs, as the runner passes them (see ragged_paged_attention.py):
//   q [T, Hq, d]; cache [N, block_size, R, 1, dp] (float32: one value per 32-bit word);
//   kv_lens [S], page_indices [S * P], cu_q_lens [S + 1], distribution [3] (int32); sinks [Hq] or [0].
// The cache layout follows kv_cache_layout.py: with d == 64, row h of a token holds [K_h | V_h] (R == Hkv, dp == 128);
// otherwise K_h is row 2h and V_h row 2h + 1, each padded to dp. Token t belongs to request r, the number of
// requests whose range ends at or before t; it is real when r < distribution[2] and t < cu_q_lens[r + 1]. Its
// position is kv_lens[r] - (its request's token count) + (its offset in the request); it sees key positions
// [max(0, p - window + 1), p]. Rows of padding tokens, and of tokens whose position lies outside the request's
// pages, are zero. A page index outside [0, N) is read as JAX indexing reads it: a negative one from the end,
// then clamped into [0, N).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Below this many multiply-adds (tokens x query heads x visible keys x head dim, bounded above) a call runs on
// the calling thread alone: waking a helper costs more than the work.
constexpr int64_t kMinParallelWork = int64_t{1} << 18;

inline float Dot(const float* a, const float* b, int64_t d) {
  int64_t i = 0;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= d; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= d; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  acc0 = _mm256_add_ps(acc0, acc1);
  float sum = maxtext_cpu::HorizontalSum(acc0);
  for (; i < d; ++i) sum = std::fma(a[i], b[i], sum);
  return sum;
}

// acc[0, d) += p * v[0, d)
inline void Axpy(float p, const float* v, float* acc, int64_t d) {
  int64_t i = 0;
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
  for (; i < d; ++i) acc[i] = std::fma(p, v[i], acc[i]);
}

struct Problem {
  int64_t num_tokens, num_q_heads, num_kv_heads, group, head_dim;
  int64_t num_blocks, block_size, token_stride, page_stride;  // floats per cache row of one token, per page
  int64_t head_stride, v_offset;                              // floats from K of head h to K of h + 1, and to V of h
  int64_t num_seqs, pages_per_seq, num_valid;
  const float* q;
  const float* cache;
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu_q_lens;
  const float* sinks;  // null without sinks
  float* out;
  float sm_scale, soft_cap;  // soft_cap 0: none
  int64_t window;            // 0: none
};

// Token t's request (the number of requests whose range ends at or before t) and position; false for a padding
// token or a position outside its request's pages.
bool Locate(const Problem& p, int64_t t, int64_t* request, int64_t* position) {
  int64_t r = 0;
  for (int64_t i = 0; i < p.num_seqs; ++i) r += p.cu_q_lens[i + 1] <= t;
  r = std::min(r, p.num_seqs - 1);
  if (r >= p.num_valid || t < p.cu_q_lens[r] || t >= p.cu_q_lens[r + 1]) return false;
  const int64_t query_len = p.cu_q_lens[r + 1] - p.cu_q_lens[r];
  const int64_t pos = static_cast<int64_t>(p.kv_lens[r]) - query_len + (t - p.cu_q_lens[r]);
  if (pos < 0 || pos >= p.pages_per_seq * p.block_size) return false;
  *request = r;
  *position = pos;
  return true;
}

// Every query head of token `t`: out[t]. The keys are walked in position order, each reading its token's cache
// row (all KV heads, one contiguous stretch of a page) once for the scores and once for the weighted sum.
void AttendToken(const Problem& p, int64_t t, std::vector<float>& scratch) {
  const int64_t d = p.head_dim, group = p.group, heads = p.num_q_heads;
  float* out = p.out + t * heads * d;
  std::memset(out, 0, sizeof(float) * heads * d);
  int64_t request, pos;
  if (!Locate(p, t, &request, &pos)) return;
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
  const int64_t keys = pos - first + 1;
  scratch.resize(heads * keys);
  float* scores = scratch.data();  // [Hq][keys]
  const float* q = p.q + t * heads * d;
  const int32_t* pages = p.page_indices + request * p.pages_per_seq;
  auto row = [&](int64_t key) {  // the token row of position `key`: KV head h starts h * head_stride floats in
    int64_t page = pages[key / p.block_size];
    if (page < 0) page += p.num_blocks;  // as JAX indexing reads a negative index, then clamps
    page = std::clamp<int64_t>(page, 0, p.num_blocks - 1);
    return p.cache + page * p.page_stride + (key % p.block_size) * p.token_stride;
  };
  for (int64_t j = 0; j < keys; ++j) {
    const float* r = row(first + j);
    for (int64_t h = 0; h < heads; ++h) {
      float s = Dot(q + h * d, r + (h / group) * p.head_stride, d) * p.sm_scale;
      if (p.soft_cap != 0.0f) s = p.soft_cap * std::tanh(s / p.soft_cap);
      scores[h * keys + j] = s;
    }
  }
  std::vector<float> inv_denom(heads);
  for (int64_t h = 0; h < heads; ++h) {
    float* e = scores + h * keys;
    float row_max = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) row_max = std::max(row_max, e[j]);
    const float sink = p.sinks != nullptr ? p.sinks[h] : 0.0f;
    if (p.sinks != nullptr) row_max = std::max(row_max, sink);
    float denom = 0.0f;
    for (int64_t j = 0; j < keys; ++j) {
      e[j] = std::exp(e[j] - row_max);
      denom += e[j];
    }
    if (p.sinks != nullptr) denom += std::exp(sink - row_max);
    inv_denom[h] = 1.0f / denom;
  }
  for (int64_t j = 0; j < keys; ++j) {
    const float* r = row(first + j) + p.v_offset;
    for (int64_t h = 0; h < heads; ++h) Axpy(scores[h * keys + j], r + (h / group) * p.head_stride, out + h * d, d);
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) out[h * d + i] *= inv_denom[h];
  }
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache,
                          ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_indices,
                          ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> distribution,
                          ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out, float sm_scale, float soft_cap,
                          int64_t sliding_window, int64_t num_kv_heads) {
  auto qd = q.dimensions();
  auto cd = cache.dimensions();
  auto od = out->dimensions();
  if (qd.size() != 3 || cd.size() != 5 || od.size() != 3 || od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2]) {
    return ffi::Error::InvalidArgument("paged_attention: q and out must be [T, Hq, d], the cache [N, bs, R, 1, dp]");
  }
  Problem p;
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_kv_heads = num_kv_heads;
  if (num_kv_heads < 1 || p.num_q_heads % num_kv_heads != 0) {
    return ffi::Error::InvalidArgument("paged_attention: Hq must be a positive multiple of num_kv_heads");
  }
  p.group = p.num_q_heads / num_kv_heads;
  const bool hd64 = p.head_dim == 64;
  const int64_t rows = cd[2], padded_dim = cd[4];
  if (cd[3] != 1 || rows != (hd64 ? num_kv_heads : 2 * num_kv_heads) || padded_dim < (hd64 ? 128 : p.head_dim)) {
    return ffi::Error::InvalidArgument("paged_attention: the cache rows do not fit Hkv and d in the float32 layout");
  }
  p.num_blocks = cd[0];
  p.block_size = cd[1];
  p.token_stride = rows * padded_dim;
  p.page_stride = p.block_size * p.token_stride;
  p.head_stride = hd64 ? padded_dim : 2 * padded_dim;
  p.v_offset = hd64 ? 64 : padded_dim;
  p.num_seqs = kv_lens.element_count();
  if (p.num_seqs < 1 || cu_q_lens.element_count() != p.num_seqs + 1 || distribution.element_count() != 3 ||
      page_indices.element_count() % p.num_seqs != 0 || p.num_blocks < 1) {
    return ffi::Error::InvalidArgument(
        "paged_attention: needs kv_lens [S], cu_q_lens [S + 1], page_indices [S * P], distribution [3] and pages");
  }
  const int64_t num_sinks = sinks.element_count();
  if (num_sinks != 0 && num_sinks != p.num_q_heads) {
    return ffi::Error::InvalidArgument("paged_attention: sinks must be [Hq] or empty");
  }
  p.pages_per_seq = page_indices.element_count() / p.num_seqs;
  p.num_valid = std::clamp<int64_t>(distribution.typed_data()[2], 0, p.num_seqs);
  p.q = q.typed_data();
  p.cache = cache.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.page_indices = page_indices.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.sinks = num_sinks ? sinks.typed_data() : nullptr;
  p.out = out->typed_data();
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window = std::max<int64_t>(0, sliding_window);
  int64_t visible = p.pages_per_seq * p.block_size;
  if (p.window > 0) visible = std::min(visible, p.window);
  if (p.num_tokens * visible * p.num_q_heads * p.head_dim < kMinParallelWork) {
    std::vector<float> scratch;
    for (int64_t t = 0; t < p.num_tokens; ++t) AttendToken(p, t, scratch);
    return ffi::Error::Success();
  }
  maxtext_cpu::ParallelChunks(p.num_tokens, [p](int64_t t) {
    thread_local std::vector<float> scratch;
    AttendToken(p, t, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // distribution
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("num_kv_heads"));
