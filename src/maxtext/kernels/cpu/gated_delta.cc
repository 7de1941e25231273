// The gated delta rule (Gated DeltaNet) over a ragged batch on x86-64 CPUs with AVX2 and FMA, as an XLA FFI
// handler that updates the recurrent states in place.
//
//   maxtext_gated_delta: for each token t of request r and value head h, with S the [dk, dv] state,
//     v' = beta * (v - e * k^T S),  out = e * q^T S + (q . k) v',  S <- e * S + k (x) v'
//
// In XLA a batch of decodes gathers each token's state, computes the new one into a buffer of its own and scatters
// it back, and a batch with any longer request runs a loop over all of its tokens; a program that may see either
// holds both behind a conditional, which copies the states in and out (a 1.2 MB copy per layer and step in a
// batch-8 decode of Qwen3-Next). Here each (request, head) runs its tokens in order on its state, in the slot the
// request writes: per token two passes over the state (k^T S and q^T S, then the update), nothing else.
//
// Inputs: q, k [T, H, dk] (already L2-normalised, q scaled; one key head per value head), v [T, H, dv], beta and
// e [T, H], query_start_loc [S + 1], read and write [S], distribution [3] (int32), states [M, H, dk, dv]; which
// request owns which tokens and reads and writes which slot is ragged_state.h's. Outputs: out [T, H, dv] (tokens of
// no request output zeros) and the states, in place.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ragged_state.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One token of one head: reads S (null: zeros), writes out [dv] and the new state into `dst` (may be S itself).
// ks and qs are scratch of dv floats each.
void Update(const float* q, const float* k, const float* v, float beta, float e, const float* s, float* dst,
            float* out, int64_t dk, int64_t dv, float* ks, float* qs) {
  std::fill(ks, ks + dv, 0.0f);
  std::fill(qs, qs + dv, 0.0f);
  const int64_t dv8 = dv / 8 * 8;
  float qk = 0.0f;
  for (int64_t i = 0; i < dk; ++i) qk += q[i] * k[i];
  if (s != nullptr) {
    // ks = k^T S and qs = q^T S, one pass over the rows of S.
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = s + i * dv;
      const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
      int64_t j = 0;
      for (; j < dv8; j += 8) {
        const __m256 sj = _mm256_loadu_ps(row + j);
        _mm256_storeu_ps(ks + j, _mm256_fmadd_ps(ki, sj, _mm256_loadu_ps(ks + j)));
        _mm256_storeu_ps(qs + j, _mm256_fmadd_ps(qi, sj, _mm256_loadu_ps(qs + j)));
      }
      for (; j < dv; ++j) {
        ks[j] += k[i] * row[j];
        qs[j] += q[i] * row[j];
      }
    }
  }
  // ks becomes v' and out is written.
  for (int64_t j = 0; j < dv; ++j) {
    ks[j] = beta * (v[j] - e * ks[j]);
    out[j] = e * qs[j] + qk * ks[j];
  }
  // S <- e * S + k (x) v', row by row (in place when dst == s).
  const __m256 ev = _mm256_set1_ps(e);
  for (int64_t i = 0; i < dk; ++i) {
    float* drow = dst + i * dv;
    const float* row = s == nullptr ? nullptr : s + i * dv;
    const __m256 ki = _mm256_set1_ps(k[i]);
    int64_t j = 0;
    for (; j < dv8; j += 8) {
      const __m256 kv = _mm256_mul_ps(ki, _mm256_loadu_ps(ks + j));
      _mm256_storeu_ps(drow + j, row == nullptr ? kv : _mm256_fmadd_ps(ev, _mm256_loadu_ps(row + j), kv));
    }
    for (; j < dv; ++j) drow[j] = (row == nullptr ? 0.0f : e * row[j]) + k[i] * ks[j];
  }
}

ffi::Error GatedDelta(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                      ffi::Buffer<ffi::F32> beta, ffi::Buffer<ffi::F32> decay, ffi::Buffer<ffi::S32> query_start_loc,
                      ffi::Buffer<ffi::S32> read, ffi::Buffer<ffi::S32> write, ffi::Buffer<ffi::S32> distribution,
                      ffi::Buffer<ffi::F32> states, ffi::ResultBuffer<ffi::F32> out,
                      ffi::ResultBuffer<ffi::F32> new_states) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = states.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || sd.size() != 4) {
    return ffi::Error::InvalidArgument("gated_delta: q, k, v must be 3-D and states 4-D");
  }
  const int64_t t_size = qd[0], heads = qd[1], dk = qd[2], dv = vd[2], slots = sd[0];
  const int64_t requests = read.element_count();
  if (kd[0] != t_size || kd[1] != heads || kd[2] != dk || vd[0] != t_size || vd[1] != heads || sd[1] != heads ||
      sd[2] != dk || sd[3] != dv || beta.element_count() != t_size * heads ||
      decay.element_count() != t_size * heads || write.element_count() != requests ||
      query_start_loc.element_count() != requests + 1 || distribution.element_count() != 3 ||
      out->element_count() != t_size * heads * dv || new_states->element_count() != states.element_count()) {
    return ffi::Error::InvalidArgument(
        "gated_delta: the shapes of q, k, v, beta, e, query_start_loc, read, write, distribution, states do not "
        "match");
  }
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * t_size * heads * dv);  // padding tokens
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *bp = beta.typed_data(), *ep = decay.typed_data();
  maxtext_cpu::RunRaggedRecurrence(
      t_size, heads, dk * dv, 2 * dv, slots, query_start_loc.typed_data(), read.typed_data(), write.typed_data(),
      requests, distribution.typed_data()[2], states.typed_data(), new_states->typed_data(),
      [=](int64_t t, int64_t h, const float* before, float* state, float* scratch) {
        const int64_t row = t * heads + h;
        Update(qp + row * dk, kp + row * dk, vp + row * dv, bp[row], ep[row], before, state, op + row * dv, dk, dv,
               scratch, scratch + dv);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaxtextGatedDelta, GatedDelta,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // read
                                  .Arg<ffi::Buffer<ffi::S32>>()  // write
                                  .Arg<ffi::Buffer<ffi::S32>>()  // distribution
                                  .Arg<ffi::Buffer<ffi::F32>>()  // states
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>());  // states, in place
