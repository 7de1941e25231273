// Small-batch fp32 matrix products for XLA on x86-64 CPUs with AVX2 and FMA, as XLA FFI handlers.
//
// A decode step multiplies a few rows (one per request) by every weight matrix. XLA's CPU dot packs the weight
// matrix on every call, so at 2 to 8 rows it runs far below both the memory bandwidth and the FMA throughput. These
// kernels read each weight once, in place:
//
//   maxtext_small_gemm_nn: y[M, N] = x[M, K] @ w[K, N]    (w row-major, as checkpoints hold dense kernels)
//   maxtext_small_gemm_nt: y[M, N] = x[M, K] @ w[N, K]^T  (w row-major, as a tied output head stores the table)
//   maxtext_small_gemm_nn_many: y_i = x @ w_i for several w_i  (one input's projections, their tasks in one call)
//
// with 1 <= M <= 8 (the NN product of 2-8 rows and the NT product of 7-8 hold the rows of `x` in the 8 lanes of a
// vector register; the NT product of 1-6 rows takes dot products of each row of w with the rows of x, each task
// streaming a range of rows of w front to back: interleaved streams of short rows read well below the bandwidth),
// and for routed experts
//
//   maxtext_expert_gemm:   y[r] = x[r] @ w[experts[r]]  (w [E, K, N], one matrix per expert, read where it lies)
//   maxtext_expert_gemm_many: y_i[r] = x[r] @ w_i[experts[r]] for several w_i  (an expert's gate and up in one call)
//
// for any number of rows, grouped by expert into chunks of up to 8 (one read of the matrix per chunk). A product is
// cut into tasks (ranges of columns, or slices of whole rows of w, each a contiguous stretch of memory) shared by
// the calling thread and this library's helper threads (parallel.h).
// Partial sums are combined in a fixed order, so a result does not depend on the threads; it differs from XLA's dot
// by float32 rounding only (the Python tests bound the difference against a float64 product).
//
// The NN products also take w in column panels, w [N / P, K, P] (panel t holds columns [t * P, t * P + P) of
// the [K, N] matrix, row by row: `cpu_gemm.to_panels`), P = kPanel, and then any number of rows. A panel is one
// contiguous stretch of memory that a task reads front to back whatever the rows of x: one row keeps the panel's P
// sums in registers (a load and an FMA per vector of w, the pattern of a plain streaming read), 2-8 rows sum it in
// the lanes into a buffer in the L1 cache, more rows go six at a time in registers while the panel stays in the
// cache. Row-major [K, N] needs slices with partial sums in memory for one row and strided column chunks for more;
// panels read faster at both (docs/architecture.md, "Weights in column panels").

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using maxtext_cpu::ParallelChunks;

namespace {

constexpr int kLanes = 8;         // rows of x per vector register
// The NN kernel cuts a product into tasks by columns when w is wider than kMaxChunkNN (chunks of a quarter of the
// columns, within [kMinChunkNN, kMaxChunkNN], multiples of 8), else by rows of w: up to kMaxSlices slices of at
// least kRowsPerSlice rows.
constexpr int64_t kMinChunkNN = 256;
constexpr int64_t kMaxChunkNN = 2048;
constexpr int64_t kRowsPerSlice = 128;
constexpr int64_t kMaxSlices = 8;
constexpr int64_t kChunkNT = 512;  // columns (rows of w) per task in the NT kernel of 7-8 rows (multiple of 8)
constexpr int64_t kRowChunkNT = 1024;  // the same for 1-6 rows (each task then reads K * 4 KiB of w)
// The NT kernel reads one row of w at a time up to kMaxRowsNT rows of x; with more, 8 rows of w side by side.
constexpr int64_t kMaxRowsNT = 6;
// One row of x reads rows of w of at least kLongRow floats (8 KiB) eight at a time (see RowAccumulate).
constexpr int64_t kLongRow = 2048;
// The expert kernel splits the rows of w into slices until it has kMinExpertTasks tasks, slices of at least
// kMinExpertSlice rows.
constexpr int64_t kMinExpertTasks = 4;
constexpr int64_t kMinExpertSlice = 64;
// Columns per panel of a weight in column panels, and the bytes of w a task of such a product reads (whole panels,
// at least one; at least two tasks when there are two panels).
constexpr int64_t kPanel = 32;
constexpr int64_t kPanelTaskBytes = 256 * 1024;

// The first 32-byte aligned float of a buffer allocated with kLanes floats to spare.
inline float* Align32(float* data) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(data) + 31) & ~uintptr_t{31});
}

// x [m, k] transposed to [k][8] (row i of x in lane i), zero-padded to 8 lanes, 32-byte aligned.
class AlignedRows {
 public:
  AlignedRows(const float* x, int64_t m, int64_t k) : AlignedRows(x, nullptr, m, k) {}
  // Rows rows[0..m) of x (rows 0..m when rows is null).
  AlignedRows(const float* x, const int64_t* rows, int64_t m, int64_t k) : storage_(k * kLanes + kLanes, 0.0f) {
    data_ = Align32(storage_.data());
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + (rows == nullptr ? i : rows[i]) * k;
      for (int64_t j = 0; j < k; ++j) data_[j * kLanes + i] = xi[j];
    }
  }
  const float* data() const { return data_; }

 private:
  std::vector<float> storage_;
  float* data_;
};

// Adds rows [k_begin, k_end) x columns [n0, n1) of x @ w to acc_buf [n1 - n0][8] (column j's 8 rows of y in
// lanes); w [K, N]; xt [K][8] holds x transposed, zero-padded to 8 rows.
void NNAccumulate(const float* xt, const float* w, float* acc_buf, int64_t k_begin, int64_t k_end, int64_t n_size,
                  int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  const int64_t width8 = width / 8 * 8;
  int64_t k0 = k_begin;
  for (; k0 + 8 <= k_end; k0 += 8) {
    const __m256 x0 = _mm256_load_ps(xt + (k0 + 0) * kLanes), x1 = _mm256_load_ps(xt + (k0 + 1) * kLanes);
    const __m256 x2 = _mm256_load_ps(xt + (k0 + 2) * kLanes), x3 = _mm256_load_ps(xt + (k0 + 3) * kLanes);
    const __m256 x4 = _mm256_load_ps(xt + (k0 + 4) * kLanes), x5 = _mm256_load_ps(xt + (k0 + 5) * kLanes);
    const __m256 x6 = _mm256_load_ps(xt + (k0 + 6) * kLanes), x7 = _mm256_load_ps(xt + (k0 + 7) * kLanes);
    const float* wk = w + k0 * n_size + n0;
    // Eight columns at a time: eight independent accumulators hide the FMA latency.
    for (int64_t j = 0; j < width8; j += 8) {
      float* a = acc_buf + j * kLanes;
      __m256 a0 = _mm256_load_ps(a), a1 = _mm256_load_ps(a + 8), a2 = _mm256_load_ps(a + 16);
      __m256 a3 = _mm256_load_ps(a + 24), a4 = _mm256_load_ps(a + 32), a5 = _mm256_load_ps(a + 40);
      __m256 a6 = _mm256_load_ps(a + 48), a7 = _mm256_load_ps(a + 56);
#define MAXTEXT_NN_ROW(r, xr)                                  \
  {                                                            \
    const float* wr = wk + (r) * n_size + j;                   \
    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 0), xr, a0); \
    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 1), xr, a1); \
    a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 2), xr, a2); \
    a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 3), xr, a3); \
    a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 4), xr, a4); \
    a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 5), xr, a5); \
    a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 6), xr, a6); \
    a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr + 7), xr, a7); \
  }
      MAXTEXT_NN_ROW(0, x0)
      MAXTEXT_NN_ROW(1, x1)
      MAXTEXT_NN_ROW(2, x2)
      MAXTEXT_NN_ROW(3, x3)
      MAXTEXT_NN_ROW(4, x4)
      MAXTEXT_NN_ROW(5, x5)
      MAXTEXT_NN_ROW(6, x6)
      MAXTEXT_NN_ROW(7, x7)
#undef MAXTEXT_NN_ROW
      _mm256_store_ps(a, a0);
      _mm256_store_ps(a + 8, a1);
      _mm256_store_ps(a + 16, a2);
      _mm256_store_ps(a + 24, a3);
      _mm256_store_ps(a + 32, a4);
      _mm256_store_ps(a + 40, a5);
      _mm256_store_ps(a + 48, a6);
      _mm256_store_ps(a + 56, a7);
    }
    for (int64_t j = width8; j < width; ++j) {
      __m256 a = _mm256_load_ps(acc_buf + j * kLanes);
      for (int r = 0; r < 8; ++r) {
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(wk + r * n_size + j), _mm256_load_ps(xt + (k0 + r) * kLanes), a);
      }
      _mm256_store_ps(acc_buf + j * kLanes, a);
    }
  }
  for (; k0 < k_end; ++k0) {
    const __m256 xr = _mm256_load_ps(xt + k0 * kLanes);
    const float* wk = w + k0 * n_size + n0;
    for (int64_t j = 0; j < width; ++j) {
      float* a = acc_buf + j * kLanes;
      _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_broadcast_ss(wk + j), xr, _mm256_load_ps(a)));
    }
  }
}

// One row: adds rows [k_begin, k_end) x columns [n0, n1) of x @ w to acc [n1 - n0]; x [K], w [K, N]. The rows of
// w are read front to back. Rows narrower than kLongRow floats are read one after the other, as one stream through
// contiguous memory, which a core reads near the bandwidth (several interleaved streams of short rows read well
// below it) while acc stays in the L1 cache. Wider rows are read eight at a time: eight long streams still read near
// the bandwidth, and acc, too large for the L1 cache, is loaded and stored once per eight rows instead of once per
// row. Each element sums its rows in the same order either way.
void RowAccumulate(const float* x, const float* w, float* acc, int64_t k_begin, int64_t k_end, int64_t n_size,
                   int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  int64_t k = k_begin;
  if (width >= kLongRow) {
    for (; k + 8 <= k_end; k += 8) {
      __m256 xr[8];
      const float* wr[8];
      for (int r = 0; r < 8; ++r) {
        xr[r] = _mm256_set1_ps(x[k + r]);
        wr[r] = w + (k + r) * n_size + n0;
      }
      int64_t j = 0;
      for (; j + 16 <= width; j += 16) {
        __m256 a = _mm256_loadu_ps(acc + j), b = _mm256_loadu_ps(acc + j + 8);
        for (int r = 0; r < 8; ++r) {
          a = _mm256_fmadd_ps(xr[r], _mm256_loadu_ps(wr[r] + j), a);
          b = _mm256_fmadd_ps(xr[r], _mm256_loadu_ps(wr[r] + j + 8), b);
        }
        _mm256_storeu_ps(acc + j, a);
        _mm256_storeu_ps(acc + j + 8, b);
      }
      for (; j < width; ++j) {
        for (int r = 0; r < 8; ++r) acc[j] = std::fma(x[k + r], wr[r][j], acc[j]);
      }
    }
  }
  for (; k < k_end; ++k) {
    const __m256 xk = _mm256_set1_ps(x[k]);
    const float* wk = w + k * n_size + n0;
    int64_t j = 0;
    for (; j + 16 <= width; j += 16) {
      _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(xk, _mm256_loadu_ps(wk + j), _mm256_loadu_ps(acc + j)));
      _mm256_storeu_ps(acc + j + 8, _mm256_fmadd_ps(xk, _mm256_loadu_ps(wk + j + 8), _mm256_loadu_ps(acc + j + 8)));
    }
    for (; j < width; ++j) acc[j] = std::fma(x[k], wk[j], acc[j]);
  }
}

// The rows [0, K) of w cut into `count` slices of whole rows (up to kMaxSlices, of at least kRowsPerSlice rows
// each, a multiple of 8 rows but the last): slice c is rows [begin(c), end(c)).
struct RowSlices {
  explicit RowSlices(int64_t k)
      : k(k), count(std::clamp<int64_t>(k / kRowsPerSlice, 1, kMaxSlices)), rows((k / count + 7) / 8 * 8) {}
  int64_t begin(int64_t c) const { return std::min(k, c * rows); }
  int64_t end(int64_t c) const { return c == count - 1 ? k : std::min(k, (c + 1) * rows); }

  int64_t k, count, rows;
};

// Adds the partial sums of slices 1..slices-1 (each `count` floats, `stride` floats apart) to slice 0's, in slice
// order, so the total does not depend on which thread summed which slice.
void AddSlices(float* sum, int64_t slices, int64_t stride, int64_t count) {
  for (int64_t slice = 1; slice < slices; ++slice) {
    const float* part = sum + slice * stride;
    for (int64_t j = 0; j < count; ++j) sum[j] += part[j];
  }
}

// Writes acc_buf [n1 - n0][8] into columns [n0, n1) of y [m, N].
// With `rows`, lane i goes to row rows[i] of y.
void NNStore(const float* acc_buf, float* y, int64_t m, int64_t n_size, int64_t n0, int64_t n1,
             const int64_t* rows = nullptr) {
  for (int64_t i = 0; i < m; ++i) {
    float* yi = y + (rows == nullptr ? i : rows[i]) * n_size + n0;
    for (int64_t j = 0; j < n1 - n0; ++j) yi[j] = acc_buf[j * kLanes + i];
  }
}

// Transposes the 8x8 block held in r0..r7 (row i in ri) in place.
inline void Transpose8x8(__m256& r0, __m256& r1, __m256& r2, __m256& r3, __m256& r4, __m256& r5, __m256& r6,
                         __m256& r7) {
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r0 = _mm256_permute2f128_ps(u0, u4, 0x20);
  r1 = _mm256_permute2f128_ps(u1, u5, 0x20);
  r2 = _mm256_permute2f128_ps(u2, u6, 0x20);
  r3 = _mm256_permute2f128_ps(u3, u7, 0x20);
  r4 = _mm256_permute2f128_ps(u0, u4, 0x31);
  r5 = _mm256_permute2f128_ps(u1, u5, 0x31);
  r6 = _mm256_permute2f128_ps(u2, u6, 0x31);
  r7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// Columns [n0, n1) of y = x @ w^T, w [N, K]; xt [K][8] holds x transposed, zero-padded to 8 rows. Eight rows of w
// at a time: each gives one accumulator over the 8 rows of x, and an 8x8 transpose turns them into 8 columns of y.
void NTChunk(const float* xt, const float* w, float* y, int64_t m, int64_t k_size, int64_t n_size, int64_t n0,
             int64_t n1) {
  alignas(32) float block[kLanes * kLanes];
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t rows = std::min<int64_t>(8, n1 - n);
    const float* wr[8];
    for (int r = 0; r < 8; ++r) wr[r] = w + (n + std::min<int64_t>(r, rows - 1)) * k_size;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t k = 0; k < k_size; ++k) {
      const __m256 xk = _mm256_load_ps(xt + k * kLanes);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[0] + k), xk, a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[1] + k), xk, a1);
      a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[2] + k), xk, a2);
      a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[3] + k), xk, a3);
      a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[4] + k), xk, a4);
      a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[5] + k), xk, a5);
      a6 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[6] + k), xk, a6);
      a7 = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[7] + k), xk, a7);
    }
    Transpose8x8(a0, a1, a2, a3, a4, a5, a6, a7);  // now a_i holds row i of x against the 8 rows of w
    if (rows == 8) {
      __m256* out[8] = {&a0, &a1, &a2, &a3, &a4, &a5, &a6, &a7};
      for (int64_t i = 0; i < m; ++i) _mm256_storeu_ps(y + i * n_size + n, *out[i]);
    } else {
      _mm256_store_ps(block + 0, a0);
      _mm256_store_ps(block + 8, a1);
      _mm256_store_ps(block + 16, a2);
      _mm256_store_ps(block + 24, a3);
      _mm256_store_ps(block + 32, a4);
      _mm256_store_ps(block + 40, a5);
      _mm256_store_ps(block + 48, a6);
      _mm256_store_ps(block + 56, a7);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t r = 0; r < rows; ++r) y[i * n_size + n + r] = block[i * kLanes + r];
      }
    }
  }
}

// One row: y[n] = x . w[n] for n in [n0, n1), w [N, K] row-major, read front to back as one stream (several
// interleaved streams of short rows read well below the bandwidth); x stays in the cache.
void NTRowChunk(const float* x, const float* w, float* y, int64_t k_size, int64_t n0, int64_t n1) {
  const int64_t k32 = k_size / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * k_size;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < k32; k += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wn + k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wn + k + 8), _mm256_loadu_ps(x + k + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wn + k + 16), _mm256_loadu_ps(x + k + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wn + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    float sum = maxtext_cpu::HorizontalSum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (int64_t k = k32; k < k_size; ++k) sum = std::fma(x[k], wn[k], sum);
    y[n] = sum;
  }
}

// 2 to 6 rows: y[i][n] = x[i] . w[n] for n in [n0, n1), i < M; w [N, K] row-major, read one row at a time front to
// back as one stream (NTChunk's 8 rows of w side by side are 8 interleaved streams, which read slower at these
// row counts), each vector of w multiplied into all M rows of x, which stay in the L1 cache. Above kMaxRowsNT
// rows NTChunk reads as well, and serves them.
template <int M>
void NTRowsChunk(const float* x, const float* w, float* y, int64_t k_size, int64_t n_size, int64_t n0, int64_t n1) {
  const int64_t k8 = k_size / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * k_size;
    __m256 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
      const __m256 wk = _mm256_loadu_ps(wn + k);
      for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + i * k_size + k), acc[i]);
    }
    for (int i = 0; i < M; ++i) {
      float sum = maxtext_cpu::HorizontalSum(acc[i]);
      for (int64_t k = k8; k < k_size; ++k) sum = std::fma(x[i * k_size + k], wn[k], sum);
      y[i * n_size + n] = sum;
    }
  }
}

// One row: y[0, kPanel) = x @ panel, panel [K, kPanel] row-major (one column panel of w). The panel's kPanel sums
// stay in registers while the panel is read front to back; each sums its rows in order.
void PanelRow(const float* x, const float* panel, float* y, int64_t k_size) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 xk = _mm256_set1_ps(x[k]);
    const float* wk = panel + k * kPanel;
    a0 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wk), a0);
    a1 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wk + 8), a1);
    a2 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wk + 16), a2);
    a3 = _mm256_fmadd_ps(xk, _mm256_loadu_ps(wk + 24), a3);
  }
  _mm256_storeu_ps(y, a0);
  _mm256_storeu_ps(y + 8, a1);
  _mm256_storeu_ps(y + 16, a2);
  _mm256_storeu_ps(y + 24, a3);
}

// R rows (R <= 6): y[r][0, kPanel) = x[r] @ panel for r < R; x rows k_size floats apart, y rows n_size apart. Half a
// panel at a time, its 16 columns of the R rows in 2R registers: per row of the panel, two loads of w, R broadcasts of
// x and 2R FMAs (a product of many rows is bound by the FMAs). Each sum runs over k in order, as in PanelRow and
// NNAccumulate, so a row's result does not depend on the rows beside it.
template <int R>
void PanelRows(const float* x, int64_t k_size, const float* panel, float* y, int64_t n_size) {
  for (int64_t half = 0; half < kPanel; half += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_size; ++k) {
      const __m256 w0 = _mm256_loadu_ps(panel + k * kPanel + half);
      const __m256 w1 = _mm256_loadu_ps(panel + k * kPanel + half + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * k_size + k);
        acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * n_size + half, acc[r][0]);
      _mm256_storeu_ps(y + r * n_size + half + 8, acc[r][1]);
    }
  }
}

// PanelRows over all m rows of x, six at a time.
void PanelManyRows(const float* x, int64_t m, int64_t k_size, const float* panel, float* y, int64_t n_size) {
  int64_t row = 0;
  for (; row + 6 <= m; row += 6) PanelRows<6>(x + row * k_size, k_size, panel, y + row * n_size, n_size);
  const float* xr = x + row * k_size;
  float* yr = y + row * n_size;
  switch (m - row) {
    case 5: PanelRows<5>(xr, k_size, panel, yr, n_size); break;
    case 4: PanelRows<4>(xr, k_size, panel, yr, n_size); break;
    case 3: PanelRows<3>(xr, k_size, panel, yr, n_size); break;
    case 2: PanelRows<2>(xr, k_size, panel, yr, n_size); break;
    case 1: PanelRows<1>(xr, k_size, panel, yr, n_size); break;
    default: break;
  }
}

// A product's sizes and operands: x transposed into lanes (only where a kernel reads it so), w and y in place;
// `panels` when w is in column panels [N / kPanel, K, kPanel].
struct Product {
  int64_t m, k, n;
  bool panels = false;
  std::shared_ptr<AlignedRows> xt;
  const float* w;
  float* y;
};

// Checks the shapes (w [K, N] or, not `transposed`, column panels [N / kPanel, K, kPanel]; [N, K] when `transposed`)
// and prepares the product. `xt`, when given, is x already transposed into lanes (for another product of the same x).
ffi::Error Prepare(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w, ffi::ResultBuffer<ffi::F32>& y, bool transposed,
                   Product* p, std::shared_ptr<AlignedRows> xt = nullptr) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  p->panels = !transposed && wd.size() == 3;
  if (xd.size() != 2 || yd.size() != 2 || (wd.size() != 2 && !p->panels)) {
    return ffi::Error::InvalidArgument("small_gemm: x and y must be 2-D, w 2-D or (NN) 3-D column panels");
  }
  if (p->panels && wd[2] != kPanel) {
    return ffi::Error::InvalidArgument("small_gemm: column panels must be 32 columns wide");
  }
  p->m = xd[0];
  p->k = xd[1];
  p->n = p->panels ? wd[0] * kPanel : (transposed ? wd[0] : wd[1]);
  const int64_t wk = p->panels ? wd[1] : (transposed ? wd[1] : wd[0]);
  // Column panels take any number of rows (8 at a time, each panel read from memory once); the others 1 to 8.
  if (p->m < 1 || (p->m > kLanes && !p->panels)) {
    return ffi::Error::InvalidArgument("small_gemm: x must have 1 to 8 rows (any number with column panels)");
  }
  if (wk != p->k || yd[0] != p->m || yd[1] != p->n) {
    return ffi::Error::InvalidArgument("small_gemm: the shapes of x, w and y do not match");
  }
  // The NN product of 2-8 rows and the NT product of 7-8 read x transposed into lanes; the others read it in place.
  if (p->m > (transposed ? kMaxRowsNT : 1) && p->m <= kLanes) {
    p->xt = xt != nullptr ? std::move(xt) : std::make_shared<AlignedRows>(x.typed_data(), p->m, p->k);
  }
  p->w = w.typed_data();
  p->y = y->typed_data();
  return ffi::Error::Success();
}

// One NN product y = x @ w cut into tasks: `Run(task)` for task in [0, tasks()) on any thread in any order, then
// `Finish()` on the calling thread. The partial sums live in the object, so keep it until Finish.
class NNProduct {
 public:
  // x [m, k] in place; xt x transposed into lanes (read for 2-8 rows; may be null for one row); w [k, n], or with
  // `panels` [n / kPanel, k, kPanel]; y [m, n].
  NNProduct(const float* x, const AlignedRows* xt, int64_t m, int64_t k, int64_t n, const float* w, float* y,
            bool panels = false)
      : x_(x), xt_(xt), m_(m), k_(k), n_(n), w_(w), y_(y), slices_(k) {
    if (panels) {
      // Whole panels per task, each written out by its task: no partial sums, no tail.
      mode_ = kPanels;
      const int64_t count = n / kPanel;
      width_ = std::clamp<int64_t>(kPanelTaskBytes / (k * kPanel * sizeof(float)), 1, std::max<int64_t>(1, count / 2));
      tasks_ = (count + width_ - 1) / width_;
    } else if (m == 1) {
      // One row: slices of whole rows of w, each read front to back as one stream into its own sums, added in
      // slice order.
      mode_ = kRow;
      tasks_ = slices_.count;
      partial_.assign(slices_.count * n, 0.0f);
      base_ = partial_.data();
    } else if (n > kMaxChunkNN) {
      // Wide: chunks of whole columns (all of K), each summed in its own buffer and written out by its task.
      mode_ = kColumns;
      width_ = std::min<int64_t>(kMaxChunkNN, std::max<int64_t>(kMinChunkNN, (n / 4 + 7) / 8 * 8));
      tasks_ = (n + width_ - 1) / width_;
    } else {
      // Narrow: slices of whole rows of w (one contiguous stretch of memory each, which the hardware prefetcher
      // follows), each summed into its own buffer; the slices' sums are added in slice order, so the result does
      // not depend on which thread ran which slice.
      mode_ = kSlices;
      tasks_ = slices_.count;
      partial_.assign(slices_.count * n * kLanes + kLanes, 0.0f);
      base_ = Align32(partial_.data());
    }
  }
  NNProduct(const NNProduct&) = delete;
  NNProduct& operator=(const NNProduct&) = delete;

  int64_t tasks() const { return tasks_; }

  void Run(int64_t c) const {
    switch (mode_) {
      case kRow:
        RowAccumulate(x_, w_, base_ + c * n_, slices_.begin(c), slices_.end(c), n_, 0, n_);
        break;
      case kColumns: {
        alignas(32) float acc_buf[kMaxChunkNN * kLanes];
        const int64_t n0 = c * width_, n1 = std::min(n_, (c + 1) * width_);
        std::memset(acc_buf, 0, sizeof(float) * (n1 - n0) * kLanes);
        NNAccumulate(xt_->data(), w_, acc_buf, 0, k_, n_, n0, n1);
        NNStore(acc_buf, y_, m_, n_, n0, n1);
        break;
      }
      case kSlices:
        NNAccumulate(xt_->data(), w_, base_ + c * n_ * kLanes, slices_.begin(c), slices_.end(c), n_, 0, n_);
        break;
      case kPanels: {
        const int64_t end = std::min(n_ / kPanel, (c + 1) * width_);
        for (int64_t t = c * width_; t < end; ++t) {
          const float* panel = w_ + t * k_ * kPanel;
          if (m_ == 1) {
            PanelRow(x_, panel, y_ + t * kPanel, k_);
            continue;
          }
          if (m_ > kLanes) {
            // Many rows (a prefill): six at a time, the panel staying in the cache while they read it.
            PanelManyRows(x_, m_, k_, panel, y_ + t * kPanel, n_);
            continue;
          }
          alignas(32) float acc_buf[kPanel * kLanes] = {};
          NNAccumulate(xt_->data(), panel, acc_buf, 0, k_, kPanel, 0, kPanel);
          NNStore(acc_buf, y_, m_, n_, t * kPanel, (t + 1) * kPanel);
        }
        break;
      }
    }
  }

  void Finish() const {
    if (mode_ == kRow) {
      AddSlices(base_, slices_.count, n_, n_);
      std::memcpy(y_, base_, sizeof(float) * n_);
    } else if (mode_ == kSlices) {
      AddSlices(base_, slices_.count, n_ * kLanes, n_ * kLanes);
      NNStore(base_, y_, m_, n_, 0, n_);
    }
  }

 private:
  enum Mode { kRow, kColumns, kSlices, kPanels };
  const float* x_;
  const AlignedRows* xt_;
  int64_t m_, k_, n_;
  const float* w_;
  float* y_;
  RowSlices slices_;
  Mode mode_ = kRow;
  int64_t tasks_ = 0, width_ = 0;  // width_: columns per task (kColumns) or panels per task (kPanels)
  std::vector<float> partial_;
  float* base_ = nullptr;
};

ffi::Error SmallGemmNN(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  Product p;
  if (ffi::Error error = Prepare(x, w, y, false, &p); error.failure()) return error;
  const NNProduct product(x.typed_data(), p.xt.get(), p.m, p.k, p.n, p.w, p.y, p.panels);
  ParallelChunks(product.tasks(), [&product](int64_t c) { product.Run(c); });
  product.Finish();
  return ffi::Error::Success();
}

// Several NN products of one x: y_i = x @ w_i (w_i [K, N_i], y_i [M, N_i]), all of their tasks in one parallel
// call, so the projections a layer takes from one input (queries, keys and values; gate and up) cost one call. Each
// y_i is computed exactly as SmallGemmNN computes it alone.
ffi::Error SmallGemmNNMany(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  if (ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument("small_gemm_nn_many: takes x, one or more w and as many results");
  }
  std::vector<std::unique_ptr<NNProduct>> products;
  std::vector<int64_t> first_task = {0};
  std::shared_ptr<AlignedRows> xt;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    Product p;
    if (ffi::Error error = Prepare(x, *w, *y, false, &p, xt); error.failure()) return error;
    xt = p.xt;  // built by the first product (2-8 rows), shared by the others
    products.push_back(std::make_unique<NNProduct>(x.typed_data(), xt.get(), p.m, p.k, p.n, p.w, p.y, p.panels));
    first_task.push_back(first_task.back() + products.back()->tasks());
  }
  ParallelChunks(first_task.back(), [&products, &first_task](int64_t task) {
    const int64_t i = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    products[i]->Run(task - first_task[i]);
  });
  for (const auto& product : products) product->Finish();
  return ffi::Error::Success();
}

ffi::Error SmallGemmNT(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  Product p;
  if (ffi::Error error = Prepare(x, w, y, true, &p); error.failure()) return error;
  if (p.m > kMaxRowsNT) {
    ParallelChunks((p.n + kChunkNT - 1) / kChunkNT, [p](int64_t c) {
      NTChunk(p.xt->data(), p.w, p.y, p.m, p.k, p.n, c * kChunkNT, std::min(p.n, (c + 1) * kChunkNT));
    });
    return ffi::Error::Success();
  }
  const float* xs = x.typed_data();
  ParallelChunks((p.n + kRowChunkNT - 1) / kRowChunkNT, [p, xs](int64_t c) {
    const int64_t n0 = c * kRowChunkNT, n1 = std::min(p.n, (c + 1) * kRowChunkNT);
    switch (p.m) {
      case 1: NTRowChunk(xs, p.w, p.y, p.k, n0, n1); break;
      case 2: NTRowsChunk<2>(xs, p.w, p.y, p.k, p.n, n0, n1); break;
      case 3: NTRowsChunk<3>(xs, p.w, p.y, p.k, p.n, n0, n1); break;
      case 4: NTRowsChunk<4>(xs, p.w, p.y, p.k, p.n, n0, n1); break;
      case 5: NTRowsChunk<5>(xs, p.w, p.y, p.k, p.n, n0, n1); break;
      default: NTRowsChunk<6>(xs, p.w, p.y, p.k, p.n, n0, n1); break;
    }
  });
  return ffi::Error::Success();
}

// The rows of an expert product grouped by expert: `order` lists the rows of each expert in row order, expert after
// expert, and each expert's run is cut into chunks of up to 8 rows (a chunk reads its expert's matrix once).
struct ExpertChunks {
  struct Chunk {
    int64_t expert, begin, size;  // rows order[begin, begin + size) of this expert
  };
  std::vector<int64_t> order;
  std::vector<Chunk> chunks;
};

// Groups rows [0, num_rows) by their expert ids (`expert`, each checked to lie in [0, num_experts)).
ffi::Error GroupByExpert(const int32_t* expert, int64_t num_rows, int64_t num_experts, ExpertChunks* groups) {
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    if (expert[r] < 0 || expert[r] >= num_experts) {
      return ffi::Error::InvalidArgument("expert_gemm: an expert id is outside [0, E)");
    }
    ++count[expert[r] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) count[e + 1] += count[e];  // start of each expert's rows
  groups->order.assign(num_rows, 0);
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t r = 0; r < num_rows; ++r) groups->order[next[expert[r]]++] = r;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t b = count[e]; b < count[e + 1]; b += kLanes) {
      groups->chunks.push_back({e, b, std::min<int64_t>(kLanes, count[e + 1] - b)});
    }
  }
  return ffi::Error::Success();
}

// y[r] = x[r] @ w[experts[r]] for r in [0, R): x [R, K], w [E, K, N] (one [K, N] matrix per expert, read in
// place), the rows grouped by `groups`. A chunk of one row is a matrix-vector product, more go in the lanes like the
// NN kernel. Columns are split into blocks only past the lanes' buffer; when there are few chunks, the rows of w are
// split into slices, so both threads have work. Cut into tasks like NNProduct: `Run(task)` for task in [0, tasks())
// on any thread, then `Finish()` on the calling thread. Slices are added in a fixed order, so a result does not
// depend on the threads.
class ExpertProduct {
 public:
  ExpertProduct(const ExpertChunks* groups, const float* x, int64_t k, const float* w, int64_t n, float* y)
      : groups_(groups), x_(x), k_(k), w_(w), n_(n), y_(y) {
    // Tasks: chunk x block of columns (blocks only when N exceeds the lanes' buffer) x slice of the rows of w (when
    // there are fewer than kMinExpertTasks chunk-blocks; a slice is contiguous memory).
    col_blocks_ = (n + kMaxChunkNN - 1) / kMaxChunkNN;
    width_ = ((n + col_blocks_ - 1) / col_blocks_ + 7) / 8 * 8;
    units_ = static_cast<int64_t>(groups->chunks.size()) * col_blocks_;
    slices_ = units_ == 0 ? 1
                          : std::clamp<int64_t>((kMinExpertTasks + units_ - 1) / units_, 1,
                                                std::max<int64_t>(1, k / kMinExpertSlice));
    slice_rows_ = (k / slices_ + 7) / 8 * 8;
    // With slices, each task sums into its own buffer [width][8]; they are added in slice order by Finish.
    if (slices_ > 1) {
      partial_.assign(units_ * slices_ * width_ * kLanes + kLanes, 0.0f);
      partial_base_ = Align32(partial_.data());
    }
  }
  ExpertProduct(const ExpertProduct&) = delete;
  ExpertProduct& operator=(const ExpertProduct&) = delete;

  int64_t tasks() const { return units_ * slices_; }

  void Run(int64_t task) const {
    const int64_t unit = task / slices_, slice = task % slices_;
    const ExpertChunks::Chunk& c = groups_->chunks[unit / col_blocks_];
    const int64_t n0 = (unit % col_blocks_) * width_, n1 = std::min(n_, n0 + width_);
    const int64_t k0 = std::min(k_, slice * slice_rows_);
    const int64_t k1 = slice == slices_ - 1 ? k_ : std::min(k_, k0 + slice_rows_);
    const float* we = w_ + c.expert * k_ * n_;
    const int64_t* rows = groups_->order.data() + c.begin;
    alignas(32) float local[kMaxChunkNN * kLanes];
    float* acc = slices_ > 1 ? partial_base_ + task * width_ * kLanes : local;
    if (c.size == 1) {
      if (slices_ == 1) acc = y_ + rows[0] * n_ + n0;  // one row sums straight into y
      std::memset(acc, 0, sizeof(float) * (n1 - n0));
      RowAccumulate(x_ + rows[0] * k_, we, acc, k0, k1, n_, n0, n1);
      return;
    }
    AlignedRows xt(x_, rows, c.size, k_);
    std::memset(acc, 0, sizeof(float) * (n1 - n0) * kLanes);
    NNAccumulate(xt.data(), we, acc, k0, k1, n_, n0, n1);
    if (slices_ == 1) NNStore(acc, y_, c.size, n_, n0, n1, rows);
  }

  void Finish() const {
    if (slices_ == 1) return;
    for (int64_t unit = 0; unit < units_; ++unit) {
      const ExpertChunks::Chunk& c = groups_->chunks[unit / col_blocks_];
      const int64_t n0 = (unit % col_blocks_) * width_, n1 = std::min(n_, n0 + width_);
      const int64_t* rows = groups_->order.data() + c.begin;
      float* sum = partial_base_ + unit * slices_ * width_ * kLanes;
      AddSlices(sum, slices_, width_ * kLanes, c.size == 1 ? n1 - n0 : (n1 - n0) * kLanes);
      if (c.size == 1) {
        std::memcpy(y_ + rows[0] * n_ + n0, sum, sizeof(float) * (n1 - n0));
      } else {
        NNStore(sum, y_, c.size, n_, n0, n1, rows);
      }
    }
  }

 private:
  const ExpertChunks* groups_;
  const float* x_;
  int64_t k_;
  const float* w_;
  int64_t n_;
  float* y_;
  int64_t col_blocks_ = 1, width_ = 0, units_ = 0, slices_ = 1, slice_rows_ = 0;
  std::vector<float> partial_;
  float* partial_base_ = nullptr;
};

// Checks one expert product's shapes: x [R, K], w [E, K, N], experts [R], y [R, N] with E = num_experts.
ffi::Error CheckExpertShapes(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w, ffi::Buffer<ffi::S32>& experts,
                             ffi::ResultBuffer<ffi::F32>& y, int64_t num_experts) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto ed = experts.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || ed.size() != 1 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("expert_gemm: x, y must be 2-D, w 3-D and experts 1-D");
  }
  if (wd[1] != xd[1] || ed[0] != xd[0] || yd[0] != xd[0] || yd[1] != wd[2] || wd[0] != num_experts) {
    return ffi::Error::InvalidArgument("expert_gemm: the shapes of x, w, experts and y do not match");
  }
  return ffi::Error::Success();
}

// Expert products of one x and one routing, y_i[r] = x[r] @ w_i[experts[r]] (w_i [E, K, N_i], the same E): the rows
// are grouped by expert once and all the products' tasks run in one parallel call.
ffi::Error RunExpertProducts(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& experts,
                             std::vector<ffi::Buffer<ffi::F32>>& ws, std::vector<ffi::ResultBuffer<ffi::F32>>& ys) {
  // The first w's E (its rank is checked below, before E is compared).
  const int64_t num_experts = ws[0].dimensions().size() == 0 ? -1 : ws[0].dimensions()[0];
  for (size_t i = 0; i < ws.size(); ++i) {
    if (ffi::Error error = CheckExpertShapes(x, ws[i], experts, ys[i], num_experts); error.failure()) return error;
  }
  ExpertChunks groups;
  if (ffi::Error error = GroupByExpert(experts.typed_data(), x.dimensions()[0], num_experts, &groups);
      error.failure()) {
    return error;
  }
  std::vector<std::unique_ptr<ExpertProduct>> products;
  std::vector<int64_t> first_task = {0};
  for (size_t i = 0; i < ws.size(); ++i) {
    products.push_back(std::make_unique<ExpertProduct>(&groups, x.typed_data(), x.dimensions()[1], ws[i].typed_data(),
                                                       ws[i].dimensions()[2], ys[i]->typed_data()));
    first_task.push_back(first_task.back() + products.back()->tasks());
  }
  ParallelChunks(first_task.back(), [&products, &first_task](int64_t task) {
    const int64_t i = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    products[i]->Run(task - first_task[i]);
  });
  for (const auto& product : products) product->Finish();
  return ffi::Error::Success();
}

ffi::Error ExpertGemm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y) {
  std::vector<ffi::Buffer<ffi::F32>> ws = {w};
  std::vector<ffi::ResultBuffer<ffi::F32>> ys = {y};
  return RunExpertProducts(x, experts, ws, ys);
}

// Several expert products in one call (an expert's gate and up): each y_i is computed exactly as ExpertGemm
// computes it alone.
ffi::Error ExpertGemmMany(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> experts, ffi::RemainingArgs ws,
                          ffi::RemainingRets ys) {
  if (ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument("expert_gemm_many: takes x, experts, one or more w and as many results");
  }
  std::vector<ffi::Buffer<ffi::F32>> weights;
  std::vector<ffi::ResultBuffer<ffi::F32>> results;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::Buffer<ffi::F32>>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    weights.push_back(*w);
    results.push_back(*y);
  }
  return RunExpertProducts(x, experts, weights, results);
}

}  // namespace

// Both handlers take x and w and return y.
#define MAXTEXT_SMALL_GEMM_BINDING  \
  ffi::Ffi::Bind()                  \
      .Arg<ffi::Buffer<ffi::F32>>() \
      .Arg<ffi::Buffer<ffi::F32>>() \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextSmallGemmNN, SmallGemmNN, MAXTEXT_SMALL_GEMM_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextSmallGemmNT, SmallGemmNT, MAXTEXT_SMALL_GEMM_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextSmallGemmNNMany, SmallGemmNNMany,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextExpertGemm, ExpertGemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextExpertGemmMany, ExpertGemmMany,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
