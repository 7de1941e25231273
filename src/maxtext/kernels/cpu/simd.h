// Small AVX helpers shared by the CPU kernels.

#ifndef MAXTEXT_KERNELS_CPU_SIMD_H_
#define MAXTEXT_KERNELS_CPU_SIMD_H_

#include <immintrin.h>

namespace maxtext_cpu {

// The sum of the 8 lanes of v.
inline float HorizontalSum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)));
}

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_SIMD_H_
