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
// streaming a range of rows of w front to back: interleaved streams of short rows read well below the bandwidth;
// the routines they share with the routed experts' products, expert_gemm.cc, are in gemm_rows.h). A product is
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
#include <string>
#include <vector>

#include "gemm_rows.h"
#include "int8_dot.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using maxtext_cpu::AddSlices;
using maxtext_cpu::Align32;
using maxtext_cpu::AlignedRows;
using maxtext_cpu::Bf16;
using maxtext_cpu::Broadcast;
using maxtext_cpu::Broadcast8;
using maxtext_cpu::kLanes;
using maxtext_cpu::Load8;
using maxtext_cpu::NNAccumulate;
using maxtext_cpu::NNStore;
using maxtext_cpu::ParallelChunks;
using maxtext_cpu::QuantizedRows;
#if MAXTEXT_INT8_DOT
using maxtext_cpu::Int4DotPanel;
using maxtext_cpu::Int8DotPanel;
#endif
using maxtext_cpu::RowAccumulate;
using maxtext_cpu::ToFloat;

namespace {

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
// Columns per panel of a weight in column panels, and the bytes of w a task of such a product reads (whole panels,
// at least one; at least two tasks when there are two panels).
constexpr int64_t kPanel = 32;
constexpr int64_t kPanelTaskBytes = 256 * 1024;
// Int8 column panels (weight-only int8, `cpu_gemm.to_int8_panels`): uint8 [N / kPanel, K / kPanel, kInt8Block],
// panel t and block b of kPanel rows holding the kPanel x kPanel int8 weights (row k, then its kPanel columns)
// followed by the kPanel float32 scales of its columns: w[k][c] = q[k][c] * scale[c].
constexpr int64_t kInt8Weights = kPanel * kPanel;
constexpr int64_t kInt8Block = kInt8Weights + kPanel * sizeof(float);
// Int4 column panels (`cpu_gemm.to_int4_panels`, int8_dot.h): the same panels and blocks, each block its weights as
// nibbles and then kPanel float16 scales. Read only with the integer dot products (MAXTEXT_INT8_DOT).
constexpr int64_t kInt4Block = kInt8Weights / 2 + kPanel * 2;

// The rows [0, K) of w cut into `count` slices of whole rows (up to kMaxSlices, of at least kRowsPerSlice rows
// each, a multiple of 8 rows but the last): slice c is rows [begin(c), end(c)).
struct RowSlices {
  explicit RowSlices(int64_t k)
      : k(k), count(std::clamp<int64_t>(k / kRowsPerSlice, 1, kMaxSlices)), rows((k / count + 7) / 8 * 8) {}
  int64_t begin(int64_t c) const { return std::min(k, c * rows); }
  int64_t end(int64_t c) const { return c == count - 1 ? k : std::min(k, (c + 1) * rows); }

  int64_t k, count, rows;
};

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
template <typename W>
void NTChunk(const float* xt, const W* w, float* y, int64_t m, int64_t k_size, int64_t n_size, int64_t n0,
             int64_t n1) {
  alignas(32) float block[kLanes * kLanes];
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t rows = std::min<int64_t>(8, n1 - n);
    const W* wr[8];
    for (int r = 0; r < 8; ++r) wr[r] = w + (n + std::min<int64_t>(r, rows - 1)) * k_size;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t k = 0; k < k_size; ++k) {
      const __m256 xk = _mm256_load_ps(xt + k * kLanes);
      a0 = _mm256_fmadd_ps(Broadcast(wr[0] + k), xk, a0);
      a1 = _mm256_fmadd_ps(Broadcast(wr[1] + k), xk, a1);
      a2 = _mm256_fmadd_ps(Broadcast(wr[2] + k), xk, a2);
      a3 = _mm256_fmadd_ps(Broadcast(wr[3] + k), xk, a3);
      a4 = _mm256_fmadd_ps(Broadcast(wr[4] + k), xk, a4);
      a5 = _mm256_fmadd_ps(Broadcast(wr[5] + k), xk, a5);
      a6 = _mm256_fmadd_ps(Broadcast(wr[6] + k), xk, a6);
      a7 = _mm256_fmadd_ps(Broadcast(wr[7] + k), xk, a7);
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
template <typename W>
void NTRowChunk(const float* x, const W* w, float* y, int64_t k_size, int64_t n0, int64_t n1) {
  const int64_t k32 = k_size / 32 * 32;
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * k_size;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < k32; k += 32) {
      a0 = _mm256_fmadd_ps(Load8(wn + k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(Load8(wn + k + 8), _mm256_loadu_ps(x + k + 8), a1);
      a2 = _mm256_fmadd_ps(Load8(wn + k + 16), _mm256_loadu_ps(x + k + 16), a2);
      a3 = _mm256_fmadd_ps(Load8(wn + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    float sum = maxtext_cpu::HorizontalSum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (int64_t k = k32; k < k_size; ++k) sum = std::fma(x[k], ToFloat(wn[k]), sum);
    y[n] = sum;
  }
}

// 2 to 6 rows: y[i][n] = x[i] . w[n] for n in [n0, n1), i < M; w [N, K] row-major, read one row at a time front to
// back as one stream (NTChunk's 8 rows of w side by side are 8 interleaved streams, which read slower at these
// row counts), each vector of w multiplied into all M rows of x, which stay in the L1 cache. Above kMaxRowsNT
// rows NTChunk reads as well, and serves them.
template <int M, typename W>
void NTRowsChunk(const float* x, const W* w, float* y, int64_t k_size, int64_t n_size, int64_t n0, int64_t n1) {
  const int64_t k8 = k_size / 8 * 8;
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * k_size;
    __m256 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k8; k += 8) {
      const __m256 wk = Load8(wn + k);
      for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(wk, _mm256_loadu_ps(x + i * k_size + k), acc[i]);
    }
    for (int i = 0; i < M; ++i) {
      float sum = maxtext_cpu::HorizontalSum(acc[i]);
      for (int64_t k = k8; k < k_size; ++k) sum = std::fma(x[i * k_size + k], ToFloat(wn[k]), sum);
      y[i * n_size + n] = sum;
    }
  }
}

// One row: y[0, kPanel) = x @ panel, panel [K, kPanel] row-major (one column panel of w). The panel's kPanel sums
// stay in registers while the panel is read front to back; each sums its rows in order.
template <typename W>
void PanelRow(const float* x, const W* panel, float* y, int64_t k_size) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 xk = _mm256_set1_ps(x[k]);
    const W* wk = panel + k * kPanel;
    a0 = _mm256_fmadd_ps(xk, Load8(wk), a0);
    a1 = _mm256_fmadd_ps(xk, Load8(wk + 8), a1);
    a2 = _mm256_fmadd_ps(xk, Load8(wk + 16), a2);
    a3 = _mm256_fmadd_ps(xk, Load8(wk + 24), a3);
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
template <int R, typename W>
void PanelRows(const float* x, int64_t k_size, const W* panel, float* y, int64_t n_size) {
  for (int64_t half = 0; half < kPanel; half += 16) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_size; ++k) {
      const __m256 w0 = Load8(panel + k * kPanel + half);
      const __m256 w1 = Load8(panel + k * kPanel + half + 8);
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
template <typename W>
void PanelManyRows(const float* x, int64_t m, int64_t k_size, const W* panel, float* y, int64_t n_size) {
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

// Eight int8 weights as float32 lanes (a 64-bit load the sign extension reads from memory itself: no separate
// load, extract or shift, which would cost as much again).
inline __m256 Int8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One row by one int8 column panel: y[0, kPanel) = x @ panel, panel [K / kPanel][kInt8Block] (above). Each block's
// kPanel sums stay in registers over its kPanel rows, then are added times the block's scales into the totals,
// also in registers, while the panel is read front to back.
void Int8PanelRow(const float* x, const uint8_t* panel, float* y, int64_t blocks) {
  __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * kInt8Block;
    const float* xb = x + b * kPanel;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < kPanel; ++k) {
      const __m256 xk = _mm256_set1_ps(xb[k]);
      const uint8_t* row = block + k * kPanel;
      a0 = _mm256_fmadd_ps(xk, Int8x8(row), a0);
      a1 = _mm256_fmadd_ps(xk, Int8x8(row + 8), a1);
      a2 = _mm256_fmadd_ps(xk, Int8x8(row + 16), a2);
      a3 = _mm256_fmadd_ps(xk, Int8x8(row + 24), a3);
    }
    const float* scale = reinterpret_cast<const float*>(block + kInt8Weights);
    t0 = _mm256_fmadd_ps(a0, _mm256_loadu_ps(scale), t0);
    t1 = _mm256_fmadd_ps(a1, _mm256_loadu_ps(scale + 8), t1);
    t2 = _mm256_fmadd_ps(a2, _mm256_loadu_ps(scale + 16), t2);
    t3 = _mm256_fmadd_ps(a3, _mm256_loadu_ps(scale + 24), t3);
  }
  _mm256_storeu_ps(y, t0);
  _mm256_storeu_ps(y + 8, t1);
  _mm256_storeu_ps(y + 16, t2);
  _mm256_storeu_ps(y + 24, t3);
}

// An int8 column panel dequantized into out [K, kPanel] float32 (q * scale), for the products of several rows,
// which then read it from the cache as a float32 panel.
void Int8PanelToFloat(const uint8_t* panel, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * kInt8Block;
    const float* scale = reinterpret_cast<const float*>(block + kInt8Weights);
    for (int64_t k = 0; k < kPanel; ++k) {
      const uint8_t* row = block + k * kPanel;
      float* o = out + (b * kPanel + k) * kPanel;
      for (int j = 0; j < kPanel; j += 8) _mm256_storeu_ps(o + j, _mm256_mul_ps(Int8x8(row + j), _mm256_loadu_ps(scale + j)));
    }
  }
}

// A product's sizes and operands: x transposed into lanes (only where a kernel reads it so), w and y in place;
// `panels` when w is in column panels [N / kPanel, K, kPanel]. W is w's element type (float, or Bf16).
template <typename W>
struct Product {
  int64_t m, k, n;
  bool panels = false;
  std::shared_ptr<AlignedRows> xt;
  const W* w;
  float* y;
};

// Calls fn(W{}) with W the C++ type of the weight element type `type` (float32 or bfloat16); an error naming
// `op` and the type otherwise.
template <typename Fn>
ffi::Error WithWeightType(const char* op, ffi::DataType type, Fn fn) {
  switch (type) {
    case ffi::DataType::F32: return fn(float{});
    case ffi::DataType::BF16: return fn(Bf16{});
    default:
      return ffi::Error::InvalidArgument(std::string(op) + ": w must be float32, bfloat16 or (NN) uint8 int8 column"
                                         " panels, got XLA element type " +
                                         std::to_string(static_cast<int>(type)));
  }
}

// Checks the shapes (w [K, N] or, not `transposed`, column panels [N / kPanel, K, kPanel]; [N, K] when `transposed`)
// and prepares the product; w's element type must be W (the caller dispatched on it). `xt`, when given, is x
// already transposed into lanes (for another product of the same x).
template <typename W>
ffi::Error Prepare(ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w, ffi::ResultBuffer<ffi::F32>& y, bool transposed,
                   Product<W>* p, std::shared_ptr<AlignedRows> xt = nullptr) {
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
  p->w = static_cast<const W*>(w.untyped_data());
  p->y = y->typed_data();
  return ffi::Error::Success();
}

// A product cut into tasks: `Run(task)` for task in [0, tasks()) on any thread in any order, then `Finish()` on
// the calling thread (several products of one x, of any weight types, share one parallel call).
class ProductTasks {
 public:
  virtual ~ProductTasks() = default;
  virtual int64_t tasks() const = 0;
  virtual void Run(int64_t task) const = 0;
  virtual void Finish() const = 0;
};

// One NN product y = x @ w cut into tasks: `Run(task)` for task in [0, tasks()) on any thread in any order, then
// `Finish()` on the calling thread. The partial sums live in the object, so keep it until Finish.
template <typename W>
class NNProduct : public ProductTasks {
 public:
  // x [m, k] in place; xt x transposed into lanes (read for 2-8 rows; may be null for one row); w [k, n], or with
  // `panels` [n / kPanel, k, kPanel]; y [m, n].
  NNProduct(const float* x, const AlignedRows* xt, int64_t m, int64_t k, int64_t n, const W* w, float* y,
            bool panels = false)
      : x_(x), xt_(xt), m_(m), k_(k), n_(n), w_(w), y_(y), slices_(k) {
    if (panels) {
      // Whole panels per task, each written out by its task: no partial sums, no tail.
      mode_ = kPanels;
      const int64_t count = n / kPanel;
      width_ = std::clamp<int64_t>(kPanelTaskBytes / (k * kPanel * sizeof(W)), 1, std::max<int64_t>(1, count / 2));
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

  int64_t tasks() const override { return tasks_; }

  void Run(int64_t c) const override {
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
          const W* panel = w_ + t * k_ * kPanel;
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

  void Finish() const override {
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
  const W* w_;
  float* y_;
  RowSlices slices_;
  Mode mode_ = kRow;
  int64_t tasks_ = 0, width_ = 0;  // width_: columns per task (kColumns) or panels per task (kPanels)
  std::vector<float> partial_;
  float* base_ = nullptr;
};

// One NN product y = x @ w with w in int8 column panels (kInt8Block above), cut into tasks of whole panels as
// NNProduct's kPanels. Where the build has the integer dot products (MAXTEXT_INT8_DOT, int8_dot.h), every row count
// reads the int8 panel in place with x rounded to 16-bit integers (`xq`). Otherwise one row reads it in place
// (Int8PanelRow); more rows dequantize it once into a float32 panel in the task's buffer, which stays in the cache
// while the float32 routines read it.
class Int8PanelProduct : public ProductTasks {
 public:
  Int8PanelProduct(const float* x, const AlignedRows* xt, const QuantizedRows* xq, int64_t m, int64_t k, int64_t n,
                   const uint8_t* w, float* y, int64_t block_bytes = kInt8Block)
      : x_(x), xt_(xt), xq_(xq), m_(m), k_(k), n_(n), w_(w), y_(y), block_bytes_(block_bytes) {
    const int64_t count = n / kPanel, panel_bytes = k / kPanel * block_bytes;
    width_ = std::clamp<int64_t>(kPanelTaskBytes / panel_bytes, 1, std::max<int64_t>(1, count / 2));
    tasks_ = (count + width_ - 1) / width_;
  }
  Int8PanelProduct(const Int8PanelProduct&) = delete;
  Int8PanelProduct& operator=(const Int8PanelProduct&) = delete;

  int64_t tasks() const override { return tasks_; }

  void Run(int64_t c) const override {
    const int64_t blocks = k_ / kPanel, end = std::min(n_ / kPanel, (c + 1) * width_);
    std::vector<float> dequantized(m_ == 1 || xq_ != nullptr ? 0 : k_ * kPanel);
    for (int64_t t = c * width_; t < end; ++t) {
      const uint8_t* panel = w_ + t * blocks * block_bytes_;
#if MAXTEXT_INT8_DOT
      if (block_bytes_ == kInt4Block) {
        Int4DotPanel(*xq_, m_, panel, blocks, kInt4Block, y_ + t * kPanel, n_);
      } else {
        Int8DotPanel(*xq_, m_, panel, blocks, kInt8Block, y_ + t * kPanel, n_);
      }
      continue;
#endif
      if (m_ == 1) {
        Int8PanelRow(x_, panel, y_ + t * kPanel, blocks);
        continue;
      }
      Int8PanelToFloat(panel, blocks, dequantized.data());
      if (m_ > kLanes) {
        PanelManyRows(x_, m_, k_, dequantized.data(), y_ + t * kPanel, n_);
        continue;
      }
      alignas(32) float acc_buf[kPanel * kLanes] = {};
      NNAccumulate(xt_->data(), dequantized.data(), acc_buf, 0, k_, kPanel, 0, kPanel);
      NNStore(acc_buf, y_, m_, n_, t * kPanel, (t + 1) * kPanel);
    }
  }

  void Finish() const override {}

 private:
  const float* x_;
  const AlignedRows* xt_;
  const QuantizedRows* xq_;  // x rounded for the integer dot products (MAXTEXT_INT8_DOT), else null
  int64_t m_, k_, n_;
  const uint8_t* w_;
  float* y_;
  int64_t block_bytes_;  // kInt8Block, or kInt4Block (int4 panels: only with MAXTEXT_INT8_DOT)
  int64_t tasks_ = 0, width_ = 0;  // width_: panels per task
};

// The operands one x shares between its products: x transposed into lanes, x rounded for the integer dot products
// (each built by the first product that reads it).
struct SharedX {
  std::shared_ptr<AlignedRows> xt;
  std::shared_ptr<QuantizedRows> xq;
};

// Checks an NN product with w in int8 column panels (uint8 [N / kPanel, K / kPanel, kInt8Block]) or, where the
// build has the integer dot products, int4 column panels ([..., kInt4Block]) and makes it.
ffi::Error MakeInt8Product(ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w, ffi::ResultBuffer<ffi::F32>& y,
                           SharedX* shared, std::unique_ptr<ProductTasks>* product) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  const bool int4 = wd.size() == 3 && wd[2] == kInt4Block && MAXTEXT_INT8_DOT;
  if (xd.size() != 2 || yd.size() != 2 || wd.size() != 3 || (wd[2] != kInt8Block && !int4)) {
    return ffi::Error::InvalidArgument(
        "small_gemm: x and y must be 2-D and uint8 w int8 column panels [N / 32, K / 32, 1152] (or, with the"
        " integer dot products, int4 column panels [N / 32, K / 32, 576])");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[0] * kPanel;
  if (m < 1 || wd[1] * kPanel != k || yd[0] != m || yd[1] != n) {
    return ffi::Error::InvalidArgument("small_gemm: the shapes of x, int8 column panels w and y do not match");
  }
#if MAXTEXT_INT8_DOT
  if (shared->xq == nullptr) shared->xq = std::make_shared<QuantizedRows>(x.typed_data(), m, k);
#else
  if (m > 1 && m <= kLanes && shared->xt == nullptr) shared->xt = std::make_shared<AlignedRows>(x.typed_data(), m, k);
#endif
  *product = std::make_unique<Int8PanelProduct>(x.typed_data(), shared->xt.get(), shared->xq.get(), m, k, n,
                                                static_cast<const uint8_t*>(w.untyped_data()), y->typed_data(),
                                                int4 ? kInt4Block : kInt8Block);
  return ffi::Error::Success();
}

// Checks one NN product y = x @ w and makes it, by w's element type: float32 or bfloat16 (row-major or column
// panels), or uint8 (int8 column panels).
ffi::Error MakeNNProduct(const char* op, ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& w,
                         ffi::ResultBuffer<ffi::F32>& y, SharedX* shared, std::unique_ptr<ProductTasks>* product) {
  if (w.element_type() == ffi::DataType::U8) return MakeInt8Product(x, w, y, shared, product);
  return WithWeightType(op, w.element_type(), [&](auto tag) {
    using W = decltype(tag);
    Product<W> p;
    if (ffi::Error error = Prepare(x, w, y, false, &p, shared->xt); error.failure()) return error;
    shared->xt = p.xt;
    *product = std::make_unique<NNProduct<W>>(x.typed_data(), p.xt.get(), p.m, p.k, p.n, p.w, p.y, p.panels);
    return ffi::Error::Success();
  });
}

ffi::Error SmallGemmNN(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  SharedX shared;
  std::unique_ptr<ProductTasks> product;
  if (ffi::Error error = MakeNNProduct("small_gemm_nn", x, w, y, &shared, &product); error.failure()) return error;
  ParallelChunks(product->tasks(), [&product](int64_t c) { product->Run(c); });
  product->Finish();
  return ffi::Error::Success();
}

// Several NN products of one x: y_i = x @ w_i (w_i [K, N_i] of any weight type, y_i [M, N_i]), all of their tasks
// in one parallel call, so the projections a layer takes from one input (queries, keys and values; gate and up) cost
// one call. Each y_i is computed exactly as SmallGemmNN computes it alone.
ffi::Error SmallGemmNNMany(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws, ffi::RemainingRets ys) {
  if (ws.size() == 0 || ws.size() != ys.size()) {
    return ffi::Error::InvalidArgument("small_gemm_nn_many: takes x, one or more w and as many results");
  }
  std::vector<std::unique_ptr<ProductTasks>> products(ws.size());
  std::vector<int64_t> first_task = {0};
  SharedX shared;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::Buffer<ffi::F32>>(i);
    if (w.has_error()) return w.error();
    if (y.has_error()) return y.error();
    if (ffi::Error error = MakeNNProduct("small_gemm_nn_many", x, *w, *y, &shared, &products[i]); error.failure()) {
      return error;
    }
    first_task.push_back(first_task.back() + products[i]->tasks());
  }
  ParallelChunks(first_task.back(), [&products, &first_task](int64_t task) {
    const int64_t i = std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    products[i]->Run(task - first_task[i]);
  });
  for (const auto& product : products) product->Finish();
  return ffi::Error::Success();
}

ffi::Error SmallGemmNT(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  return WithWeightType("small_gemm_nt", w.element_type(), [&](auto tag) {
    using W = decltype(tag);
    Product<W> p;
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
  });
}

}  // namespace

// Both handlers take x and w (float32 or bfloat16; for NN also uint8 int8 panels; checked by the handler) and
// return y.
#define MAXTEXT_SMALL_GEMM_BINDING  \
  ffi::Ffi::Bind()                  \
      .Arg<ffi::Buffer<ffi::F32>>() \
      .Arg<ffi::AnyBuffer>()        \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextSmallGemmNN, SmallGemmNN, MAXTEXT_SMALL_GEMM_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextSmallGemmNT, SmallGemmNT, MAXTEXT_SMALL_GEMM_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextSmallGemmNNMany, SmallGemmNNMany,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().RemainingArgs().RemainingRets());
