// The row routines the CPU matrix kernels share (small_gemm.cc's dense products, expert_gemm.cc's routed experts):
// x's rows in the lanes of a vector register (NNAccumulate), one row streaming w (RowAccumulate), and the buffers
// and partial sums around them. Weights are float32 or bfloat16 (W), widened in registers; sums are float32.

#ifndef MAXTEXT_KERNELS_CPU_GEMM_ROWS_H_
#define MAXTEXT_KERNELS_CPU_GEMM_ROWS_H_

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace maxtext_cpu {

constexpr int kLanes = 8;  // rows of x per vector register
// One row of x reads rows of w of at least kLongRow floats (8 KiB) eight at a time (see RowAccumulate).
constexpr int64_t kLongRow = 2048;

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
// lanes); w [K, N] of float32 or bfloat16 (W); xt [K][8] holds x transposed, zero-padded to 8 rows.
template <typename W>
void NNAccumulate(const float* xt, const W* w, float* acc_buf, int64_t k_begin, int64_t k_end, int64_t n_size,
                  int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  const int64_t width8 = width / 8 * 8;
  int64_t k0 = k_begin;
  for (; k0 + 8 <= k_end; k0 += 8) {
    const __m256 x0 = _mm256_load_ps(xt + (k0 + 0) * kLanes), x1 = _mm256_load_ps(xt + (k0 + 1) * kLanes);
    const __m256 x2 = _mm256_load_ps(xt + (k0 + 2) * kLanes), x3 = _mm256_load_ps(xt + (k0 + 3) * kLanes);
    const __m256 x4 = _mm256_load_ps(xt + (k0 + 4) * kLanes), x5 = _mm256_load_ps(xt + (k0 + 5) * kLanes);
    const __m256 x6 = _mm256_load_ps(xt + (k0 + 6) * kLanes), x7 = _mm256_load_ps(xt + (k0 + 7) * kLanes);
    const W* wk = w + k0 * n_size + n0;
    // Eight columns at a time: eight independent accumulators hide the FMA latency.
    for (int64_t j = 0; j < width8; j += 8) {
      float* a = acc_buf + j * kLanes;
      __m256 a0 = _mm256_load_ps(a), a1 = _mm256_load_ps(a + 8), a2 = _mm256_load_ps(a + 16);
      __m256 a3 = _mm256_load_ps(a + 24), a4 = _mm256_load_ps(a + 32), a5 = _mm256_load_ps(a + 40);
      __m256 a6 = _mm256_load_ps(a + 48), a7 = _mm256_load_ps(a + 56);
#define MAXTEXT_NN_ROW(r, xr)                          \
  {                                                    \
    const Broadcast8<W> wr(wk + (r) * n_size + j);     \
    a0 = _mm256_fmadd_ps(wr[0], xr, a0);               \
    a1 = _mm256_fmadd_ps(wr[1], xr, a1);               \
    a2 = _mm256_fmadd_ps(wr[2], xr, a2);               \
    a3 = _mm256_fmadd_ps(wr[3], xr, a3);               \
    a4 = _mm256_fmadd_ps(wr[4], xr, a4);               \
    a5 = _mm256_fmadd_ps(wr[5], xr, a5);               \
    a6 = _mm256_fmadd_ps(wr[6], xr, a6);               \
    a7 = _mm256_fmadd_ps(wr[7], xr, a7);               \
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
        a = _mm256_fmadd_ps(Broadcast(wk + r * n_size + j), _mm256_load_ps(xt + (k0 + r) * kLanes), a);
      }
      _mm256_store_ps(acc_buf + j * kLanes, a);
    }
  }
  for (; k0 < k_end; ++k0) {
    const __m256 xr = _mm256_load_ps(xt + k0 * kLanes);
    const W* wk = w + k0 * n_size + n0;
    for (int64_t j = 0; j < width; ++j) {
      float* a = acc_buf + j * kLanes;
      _mm256_store_ps(a, _mm256_fmadd_ps(Broadcast(wk + j), xr, _mm256_load_ps(a)));
    }
  }
}

// One row: adds rows [k_begin, k_end) x columns [n0, n1) of x @ w to acc [n1 - n0]; x [K], w [K, N]. The rows of
// w are read front to back. Rows narrower than kLongRow floats are read one after the other, as one stream through
// contiguous memory, which a core reads near the bandwidth (several interleaved streams of short rows read well
// below it) while acc stays in the L1 cache. Wider rows are read eight at a time: eight long streams still read near
// the bandwidth, and acc, too large for the L1 cache, is loaded and stored once per eight rows instead of once per
// row. Each element sums its rows in the same order either way.
template <typename W>
void RowAccumulate(const float* x, const W* w, float* acc, int64_t k_begin, int64_t k_end, int64_t n_size,
                   int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  int64_t k = k_begin;
  if (width >= kLongRow) {
    for (; k + 8 <= k_end; k += 8) {
      __m256 xr[8];
      const W* wr[8];
      for (int r = 0; r < 8; ++r) {
        xr[r] = _mm256_set1_ps(x[k + r]);
        wr[r] = w + (k + r) * n_size + n0;
      }
      int64_t j = 0;
      for (; j + 16 <= width; j += 16) {
        __m256 a = _mm256_loadu_ps(acc + j), b = _mm256_loadu_ps(acc + j + 8);
        for (int r = 0; r < 8; ++r) {
          a = _mm256_fmadd_ps(xr[r], Load8(wr[r] + j), a);
          b = _mm256_fmadd_ps(xr[r], Load8(wr[r] + j + 8), b);
        }
        _mm256_storeu_ps(acc + j, a);
        _mm256_storeu_ps(acc + j + 8, b);
      }
      for (; j < width; ++j) {
        for (int r = 0; r < 8; ++r) acc[j] = std::fma(x[k + r], ToFloat(wr[r][j]), acc[j]);
      }
    }
  }
  for (; k < k_end; ++k) {
    const __m256 xk = _mm256_set1_ps(x[k]);
    const W* wk = w + k * n_size + n0;
    int64_t j = 0;
    for (; j + 16 <= width; j += 16) {
      _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(xk, Load8(wk + j), _mm256_loadu_ps(acc + j)));
      _mm256_storeu_ps(acc + j + 8, _mm256_fmadd_ps(xk, Load8(wk + j + 8), _mm256_loadu_ps(acc + j + 8)));
    }
    for (; j < width; ++j) acc[j] = std::fma(x[k], ToFloat(wk[j]), acc[j]);
  }
}

// Adds the partial sums of slices 1..slices-1 (each `count` floats, `stride` floats apart) to slice 0's, in slice
// order, so the total does not depend on which thread summed which slice.
inline void AddSlices(float* sum, int64_t slices, int64_t stride, int64_t count) {
  for (int64_t slice = 1; slice < slices; ++slice) {
    const float* part = sum + slice * stride;
    for (int64_t j = 0; j < count; ++j) sum[j] += part[j];
  }
}

// Writes acc_buf [n1 - n0][8] into columns [n0, n1) of y [m, N].
// With `rows`, lane i goes to row rows[i] of y.
inline void NNStore(const float* acc_buf, float* y, int64_t m, int64_t n_size, int64_t n0, int64_t n1,
                    const int64_t* rows = nullptr) {
  for (int64_t i = 0; i < m; ++i) {
    float* yi = y + (rows == nullptr ? i : rows[i]) * n_size + n0;
    for (int64_t j = 0; j < n1 - n0; ++j) yi[j] = acc_buf[j * kLanes + i];
  }
}

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_GEMM_ROWS_H_
