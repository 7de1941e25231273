// Mamba2's selective-state recurrence over a ragged batch on x86-64 CPUs with AVX2 and FMA, as an XLA FFI handler
// that updates the SSM states in place.
//
//   maxtext_mamba2: for each token t of request r and head h, with S the [hd, N] state and B, C the [N] rows of
//     the head's group,  S <- decay * S + (delta * x) (x) B,  y = S C + D * x
//
// In XLA the recurrence gathers, computes and scatters the states of a batch of decodes and loops over the tokens
// of any longer batch, both behind a conditional that copies the states in and out. Here each (request, head) runs
// its tokens in order on its state, in the slot the request writes: one pass over the state per token.
//
// Inputs: x [T, H, hd], delta and decay [T, H], B and C [T, G, N] (head h reads group h / (H / G)), D [H],
// query_start_loc [S + 1], read and write [S], distribution [3] (int32), states [M, H, hd, N]; which request owns
// which tokens and reads and writes which slot is ragged_state.h's. Outputs: y [T, H, hd] (tokens of no request
// output zeros) and the states, in place.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ragged_state.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One token of one head: reads S [hd, n] (null: zeros), writes the new state into `dst` (may be S itself) and
// y [hd]. Each row of the state is updated and multiplied by C in one pass.
void Update(const float* x, const float* b, const float* c, float delta, float decay, float skip, const float* s,
            float* dst, float* y, int64_t hd, int64_t n) {
  const int64_t n8 = n / 8 * 8;
  const __m256 dv = _mm256_set1_ps(decay);
  for (int64_t p = 0; p < hd; ++p) {
    const float* row = s == nullptr ? nullptr : s + p * n;
    float* drow = dst + p * n;
    const float dx = delta * x[p];
    const __m256 dxv = _mm256_set1_ps(dx);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j < n8; j += 8) {
      const __m256 input = _mm256_mul_ps(dxv, _mm256_loadu_ps(b + j));
      const __m256 next = row == nullptr ? input : _mm256_fmadd_ps(dv, _mm256_loadu_ps(row + j), input);
      _mm256_storeu_ps(drow + j, next);
      acc = _mm256_fmadd_ps(next, _mm256_loadu_ps(c + j), acc);
    }
    float sum = maxtext_cpu::HorizontalSum(acc);
    for (; j < n; ++j) {
      const float next = (row == nullptr ? 0.0f : decay * row[j]) + dx * b[j];
      drow[j] = next;
      sum = std::fma(next, c[j], sum);
    }
    y[p] = sum + skip * x[p];
  }
}

ffi::Error Mamba2(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> delta, ffi::Buffer<ffi::F32> decay,
                  ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> c, ffi::Buffer<ffi::F32> skip,
                  ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> read, ffi::Buffer<ffi::S32> write,
                  ffi::Buffer<ffi::S32> distribution, ffi::Buffer<ffi::F32> states, ffi::ResultBuffer<ffi::F32> y,
                  ffi::ResultBuffer<ffi::F32> new_states) {
  auto xd = x.dimensions(), bd = b.dimensions(), cd = c.dimensions(), sd = states.dimensions();
  if (xd.size() != 3 || bd.size() != 3 || cd.size() != 3 || sd.size() != 4) {
    return ffi::Error::InvalidArgument("mamba2: x, B, C must be 3-D and states 4-D");
  }
  const int64_t t_size = xd[0], heads = xd[1], hd = xd[2], groups = bd[1], n = bd[2], slots = sd[0];
  const int64_t requests = read.element_count();
  if (bd[0] != t_size || groups < 1 || heads % groups != 0 || cd[0] != t_size || cd[1] != groups || cd[2] != n ||
      sd[1] != heads || sd[2] != hd || sd[3] != n || delta.element_count() != t_size * heads ||
      decay.element_count() != t_size * heads || skip.element_count() != heads ||
      write.element_count() != requests || query_start_loc.element_count() != requests + 1 ||
      distribution.element_count() != 3 || y->element_count() != t_size * heads * hd ||
      new_states->element_count() != states.element_count()) {
    return ffi::Error::InvalidArgument(
        "mamba2: the shapes of x, delta, decay, B, C, D, query_start_loc, read, write, distribution, states do not "
        "match");
  }
  float* yp = y->typed_data();
  std::memset(yp, 0, sizeof(float) * t_size * heads * hd);  // padding tokens
  const float *xp = x.typed_data(), *deltap = delta.typed_data(), *decayp = decay.typed_data();
  const float *bp = b.typed_data(), *cp = c.typed_data(), *dp = skip.typed_data();
  const int64_t per_group = heads / groups;
  maxtext_cpu::RunRaggedRecurrence(
      t_size, heads, hd * n, 0, slots, query_start_loc.typed_data(), read.typed_data(), write.typed_data(), requests,
      distribution.typed_data()[2], states.typed_data(), new_states->typed_data(),
      [=](int64_t t, int64_t h, const float* before, float* state, float*) {
        const int64_t row = t * heads + h, group_row = t * groups + h / per_group;
        Update(xp + row * hd, bp + group_row * n, cp + group_row * n, deltap[row], decayp[row], dp[h], before, state,
               yp + row * hd, hd, n);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextMamba2, Mamba2,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // delta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // decay
                                  .Arg<ffi::Buffer<ffi::F32>>()  // B
                                  .Arg<ffi::Buffer<ffi::F32>>()  // C
                                  .Arg<ffi::Buffer<ffi::F32>>()  // D
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // read
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write
                                  .Arg<ffi::Buffer<ffi::S32>>()  // distribution
                                  .Arg<ffi::Buffer<ffi::F32>>()  // states
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Ret<ffi::Buffer<ffi::F32>>());  // states, in place
