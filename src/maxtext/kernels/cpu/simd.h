// Small AVX helpers shared by the CPU kernels, and the weight element types the matrix products read.

#ifndef MAXTEXT_KERNELS_CPU_SIMD_H_
#define MAXTEXT_KERNELS_CPU_SIMD_H_

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace maxtext_cpu {

// The sum of the 8 lanes of v.
inline float HorizontalSum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1)));
}

// A weight element: float32, or bfloat16 (its 16 bits, the top half of a float32's) widened to float32 in registers.
using Bf16 = uint16_t;

inline float ToFloat(float v) { return v; }
inline float ToFloat(Bf16 v) {
  const uint32_t bits = uint32_t{v} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Eight consecutive weights as float32 lanes.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const Bf16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// One weight in all 8 lanes.
inline __m256 Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline __m256 Broadcast(const Bf16* p) { return _mm256_set1_ps(ToFloat(*p)); }

// Eight consecutive weights, each of which `operator[](i)` gives in all 8 lanes: a broadcast from memory for
// float32, a lane permute of one widened load for bfloat16 (eight scalar widenings would cost more).
template <typename W>
class Broadcast8;

template <>
class Broadcast8<float> {
 public:
  explicit Broadcast8(const float* p) : p_(p) {}
  __m256 operator[](int i) const { return _mm256_broadcast_ss(p_ + i); }

 private:
  const float* p_;
};

template <>
class Broadcast8<Bf16> {
 public:
  explicit Broadcast8(const Bf16* p) : v_(Load8(p)) {}
  __m256 operator[](int i) const { return _mm256_permutevar8x32_ps(v_, _mm256_set1_epi32(i)); }

 private:
  __m256 v_;
};

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_SIMD_H_
