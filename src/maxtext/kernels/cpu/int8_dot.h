// Int8 column panels (weight-only int8) by integer dot products: x is rounded per row and per block of kPanel
// values along K to 16-bit integers, and each block's products are summed exactly in int32 by AVX-512 VNNI's byte
// dot products (64 products per instruction, where the float32 routines widen each int8 weight to float32 and take 8
// per FMA). The rounding keeps about 15 bits of each block (a step of the block's largest magnitude / 32639): far
// finer than the int8 weights, which carry the error of the product.
//
// A block of an int8 panel holds its kPanel x kPanel weights row by row (small_gemm.cc's kInt8Block), then a float32
// scale per column. VNNI's dot product sums four adjacent bytes of each 32-bit lane, so each group of four rows is
// interleaved in registers (one two-source byte permute per 16 columns) into lanes of one column and four rows. The
// permute needs AVX-512 VBMI, the dot product AVX-512 VNNI; a build without them (MAXTEXT_INT8_DOT 0) declares
// QuantizedRows only, and the float32 routines serve int8 panels.
//
// The dot product multiplies unsigned bytes by signed ones. The weights are flipped to unsigned (w + 128) and x's
// 16-bit integer q is cut into two signed bytes, q = 256 hi + lo (lo in [-128, 127]; |q| <= 32639 keeps hi in
// [-127, 127]); per block, with S = the block's sum of q,
//   sum_k w[k][c] q[k] = 256 sum_k (w[k][c] + 128) hi[k] + sum_k (w[k][c] + 128) lo[k] - 128 S,
// every term exact in int32, and y[r][c] adds that times xscale[r][b] * wscale[b][c] over the blocks b, in order.

#ifndef MAXTEXT_KERNELS_CPU_INT8_DOT_H_
#define MAXTEXT_KERNELS_CPU_INT8_DOT_H_

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace maxtext_cpu {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define MAXTEXT_INT8_DOT 1
#else
#define MAXTEXT_INT8_DOT 0
#endif

#if MAXTEXT_INT8_DOT

constexpr int64_t kQuantBlock = 32;  // values of x per scale (small_gemm.cc's kPanel: one block of a panel)
constexpr float kQuantLevels = 32639.0f;  // the largest |q|: 256 * 127 + 127, so that hi stays in [-127, 127]

// x [m, k] (k a multiple of kQuantBlock) rounded per row and block: q = round(x / amax * kQuantLevels) (float32
// products in that order: x times 1 / amax, unless that overflows, then x / amax; to nearest, ties to even),
// scale = amax / kQuantLevels, amax the block's largest magnitude (0 for an all-zero block, whose q are 0; NaN when
// the block holds an infinity or NaN, so that the row's results are NaN as a float32 product's would be). q is kept
// as its two bytes hi and lo (q = 256 hi + lo) and each block's sum of q.
class QuantizedRows {
 public:
  QuantizedRows(const float* x, int64_t m, int64_t k)
      : k_(k), hi_(m * k), lo_(m * k), scale_(m * k / kQuantBlock), sum_(m * k / kQuantBlock) {
    const __m512 levels = _mm512_set1_ps(kQuantLevels);
    for (int64_t block = 0; block < m * k / kQuantBlock; ++block) {
      const float* xb = x + block * kQuantBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      // x - x is NaN for an infinity or NaN, 0 otherwise.
      const __m512 zero_if_finite = _mm512_add_ps(_mm512_sub_ps(x0, x0), _mm512_sub_ps(x1, x1));
      const bool finite = std::isfinite(_mm512_reduce_add_ps(zero_if_finite));
      __m512i q0 = _mm512_setzero_si512(), q1 = q0;
      if (finite && amax > 0.0f) {
        // 1 / amax overflows for the smallest subnormal magnitudes; x / amax (at most 1 in magnitude) does not.
        const float reciprocal = 1.0f / amax;
        const bool tiny = !std::isfinite(reciprocal);
        const __m512 inverse = _mm512_set1_ps(reciprocal);
        const __m512 amax_v = _mm512_set1_ps(amax);
        const __m512 r0 = tiny ? _mm512_div_ps(x0, amax_v) : _mm512_mul_ps(x0, inverse);
        const __m512 r1 = tiny ? _mm512_div_ps(x1, amax_v) : _mm512_mul_ps(x1, inverse);
        q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(r0, levels), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(r1, levels), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      const __m512i half = _mm512_set1_epi32(128);
      const __m512i hi0 = _mm512_srai_epi32(_mm512_add_epi32(q0, half), 8);
      const __m512i hi1 = _mm512_srai_epi32(_mm512_add_epi32(q1, half), 8);
      const __m512i lo0 = _mm512_sub_epi32(q0, _mm512_slli_epi32(hi0, 8));
      const __m512i lo1 = _mm512_sub_epi32(q1, _mm512_slli_epi32(hi1, 8));
      auto* hb = reinterpret_cast<__m128i*>(hi_.data() + block * kQuantBlock);
      auto* lb = reinterpret_cast<__m128i*>(lo_.data() + block * kQuantBlock);
      _mm_storeu_si128(hb, _mm512_cvtepi32_epi8(hi0));
      _mm_storeu_si128(hb + 1, _mm512_cvtepi32_epi8(hi1));
      _mm_storeu_si128(lb, _mm512_cvtepi32_epi8(lo0));
      _mm_storeu_si128(lb + 1, _mm512_cvtepi32_epi8(lo1));
      scale_[block] = finite ? amax / kQuantLevels : NAN;
      sum_[block] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
  }

  // Row r's high and low bytes of q, block scales and block sums of q.
  const int8_t* hi(int64_t r) const { return hi_.data() + r * k_; }
  const int8_t* lo(int64_t r) const { return lo_.data() + r * k_; }
  const float* scale(int64_t r) const { return scale_.data() + r * k_ / kQuantBlock; }
  const int32_t* sum(int64_t r) const { return sum_.data() + r * k_ / kQuantBlock; }

 private:
  int64_t k_;
  std::vector<int8_t> hi_, lo_;
  std::vector<float> scale_;
  std::vector<int32_t> sum_;
};

// The byte permute that turns rows 4g..4g+3 of a block (two 64-byte loads: rows 4g, 4g+1 and rows 4g+2, 4g+3) into
// lanes of one column and four rows: byte 4j + i of the result is row i of column j (half 0: columns 0-15; half 1:
// 16-31).
inline __m512i InterleaveIndex(int half) {
  alignas(64) uint8_t index[64];
  for (int j = 0; j < 16; ++j) {
    for (int i = 0; i < 4; ++i) index[4 * j + i] = static_cast<uint8_t>(i * 32 + half * 16 + j);
  }
  return _mm512_load_si512(index);
}

// Four bytes of a row of x, from byte `at`, in every 32-bit lane.
inline __m512i Four(const int8_t* row, int64_t at) {
  int32_t four;
  std::memcpy(&four, row + at, sizeof(four));
  return _mm512_set1_epi32(four);
}

// R rows (1 <= R <= 4) of rounded x by one int8 column panel of `blocks` blocks (block_bytes each, laid out as above
// with kPanel = 32): y[r][0, 32) for r < R, y rows n_size floats apart. Per block, each row's int32 sums of hi and
// of lo (16 columns each) run over the block's eight groups of four rows; one row splits them over even and odd
// groups too, so that enough independent dot product chains hide each other's latency.
template <int R>
void Int8DotPanelRows(const QuantizedRows& x, int64_t row0, const uint8_t* panel, int64_t blocks, int64_t block_bytes,
                      float* y, int64_t n_size) {
  constexpr int kSplit = R == 1 ? 2 : 1;
  const __m512i index0 = InterleaveIndex(0), index1 = InterleaveIndex(1);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    __m512i hi[R][2][kSplit], lo[R][2][kSplit];
    for (int r = 0; r < R; ++r) {
      for (int s = 0; s < kSplit; ++s) hi[r][0][s] = hi[r][1][s] = lo[r][0][s] = lo[r][1][s] = _mm512_setzero_si512();
    }
    for (int g = 0; g < 8; ++g) {
      const __m512i rows01 = _mm512_loadu_si512(block + g * 128);
      const __m512i rows23 = _mm512_loadu_si512(block + g * 128 + 64);
      const __m512i w0 = _mm512_xor_si512(_mm512_permutex2var_epi8(rows01, index0, rows23), flip);
      const __m512i w1 = _mm512_xor_si512(_mm512_permutex2var_epi8(rows01, index1, rows23), flip);
      const int s = g % kSplit;
      const int64_t at = b * kQuantBlock + 4 * g;
      for (int r = 0; r < R; ++r) {
        const __m512i xh = Four(x.hi(row0 + r), at), xl = Four(x.lo(row0 + r), at);
        hi[r][0][s] = _mm512_dpbusd_epi32(hi[r][0][s], w0, xh);
        hi[r][1][s] = _mm512_dpbusd_epi32(hi[r][1][s], w1, xh);
        lo[r][0][s] = _mm512_dpbusd_epi32(lo[r][0][s], w0, xl);
        lo[r][1][s] = _mm512_dpbusd_epi32(lo[r][1][s], w1, xl);
      }
    }
    const float* wscale = reinterpret_cast<const float*>(block + 32 * 32);
    const __m512 scale[2] = {_mm512_loadu_ps(wscale), _mm512_loadu_ps(wscale + 16)};
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(128 * x.sum(row0 + r)[b]);
      const __m512 xscale = _mm512_set1_ps(x.scale(row0 + r)[b]);
      for (int h = 0; h < 2; ++h) {
        __m512i sum_hi = hi[r][h][0], sum_lo = lo[r][h][0];
        if constexpr (kSplit == 2) {
          sum_hi = _mm512_add_epi32(sum_hi, hi[r][h][1]);
          sum_lo = _mm512_add_epi32(sum_lo, lo[r][h][1]);
        }
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(sum_hi, 8), sum_lo), offset);
        total[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale[h], xscale), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * n_size, total[r][0]);
    _mm512_storeu_ps(y + r * n_size + 16, total[r][1]);
  }
}

// All m rows of rounded x by one int8 column panel, four rows at a time (the panel stays in the cache).
inline void Int8DotPanel(const QuantizedRows& x, int64_t m, const uint8_t* panel, int64_t blocks, int64_t block_bytes,
                         float* y, int64_t n_size) {
  int64_t row = 0;
  for (; row + 4 <= m; row += 4) Int8DotPanelRows<4>(x, row, panel, blocks, block_bytes, y + row * n_size, n_size);
  float* yr = y + row * n_size;
  switch (m - row) {
    case 3: Int8DotPanelRows<3>(x, row, panel, blocks, block_bytes, yr, n_size); break;
    case 2: Int8DotPanelRows<2>(x, row, panel, blocks, block_bytes, yr, n_size); break;
    case 1: Int8DotPanelRows<1>(x, row, panel, blocks, block_bytes, yr, n_size); break;
    default: break;
  }
}

// Int4 column panels (`cpu_gemm.to_int4_panels`: the coarse copy of a tied head that nominates a greedy step's
// candidates) by the same integer dot products. A block holds its kPanel x kPanel weights as unsigned nibbles
// u = q + 8 (q in [-8, 7]), group g of four rows in 64 bytes: byte i holds byte i of rows 4g, 4g+1 (as int8 panels
// lay them out) in its low nibble and byte i of rows 4g+2, 4g+3 in its high one; then the kPanel float16 scales of
// its columns. Unpacking a group gives the two 64-byte row pairs of an int8 block, unsigned already, so the sums
// take 8 S where the int8 ones take 128 S.
template <int R>
void Int4DotPanelRows(const QuantizedRows& x, int64_t row0, const uint8_t* panel, int64_t blocks, int64_t block_bytes,
                      float* y, int64_t n_size) {
  const __m512i index0 = InterleaveIndex(0), index1 = InterleaveIndex(1);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 total[R][2];
  for (int r = 0; r < R; ++r) total[r][0] = total[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    __m512i hi[R][2], lo[R][2];
    for (int r = 0; r < R; ++r) hi[r][0] = hi[r][1] = lo[r][0] = lo[r][1] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      const __m512i packed = _mm512_loadu_si512(block + g * 64);
      const __m512i rows01 = _mm512_and_si512(packed, nibble);
      const __m512i rows23 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
      const __m512i w0 = _mm512_permutex2var_epi8(rows01, index0, rows23);
      const __m512i w1 = _mm512_permutex2var_epi8(rows01, index1, rows23);
      const int64_t at = b * kQuantBlock + 4 * g;
      for (int r = 0; r < R; ++r) {
        const __m512i xh = Four(x.hi(row0 + r), at), xl = Four(x.lo(row0 + r), at);
        hi[r][0] = _mm512_dpbusd_epi32(hi[r][0], w0, xh);
        hi[r][1] = _mm512_dpbusd_epi32(hi[r][1], w1, xh);
        lo[r][0] = _mm512_dpbusd_epi32(lo[r][0], w0, xl);
        lo[r][1] = _mm512_dpbusd_epi32(lo[r][1], w1, xl);
      }
    }
    const __m256i* wscale = reinterpret_cast<const __m256i*>(block + 8 * 64);
    const __m512 scale[2] = {_mm512_cvtph_ps(_mm256_loadu_si256(wscale)), _mm512_cvtph_ps(_mm256_loadu_si256(wscale + 1))};
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(8 * x.sum(row0 + r)[b]);
      const __m512 xscale = _mm512_set1_ps(x.scale(row0 + r)[b]);
      for (int h = 0; h < 2; ++h) {
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[r][h], 8), lo[r][h]), offset);
        total[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale[h], xscale), total[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * n_size, total[r][0]);
    _mm512_storeu_ps(y + r * n_size + 16, total[r][1]);
  }
}

// All m rows of rounded x by one int4 column panel, four rows at a time.
inline void Int4DotPanel(const QuantizedRows& x, int64_t m, const uint8_t* panel, int64_t blocks, int64_t block_bytes,
                         float* y, int64_t n_size) {
  int64_t row = 0;
  for (; row + 4 <= m; row += 4) Int4DotPanelRows<4>(x, row, panel, blocks, block_bytes, y + row * n_size, n_size);
  float* yr = y + row * n_size;
  switch (m - row) {
    case 3: Int4DotPanelRows<3>(x, row, panel, blocks, block_bytes, yr, n_size); break;
    case 2: Int4DotPanelRows<2>(x, row, panel, blocks, block_bytes, yr, n_size); break;
    case 1: Int4DotPanelRows<1>(x, row, panel, blocks, block_bytes, yr, n_size); break;
    default: break;
  }
}

#else

class QuantizedRows;  // the pointers small_gemm.cc keeps stay null

#endif  // MAXTEXT_INT8_DOT

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_INT8_DOT_H_
