// A per-token recurrence over a ragged batch on state slots updated in place: the part of the recurrent kernels
// (gated_delta.cc, mamba2.cc) that is the same whatever the recurrence.
//
// Request r < distribution[2] owns tokens [query_start_loc[r], query_start_loc[r + 1]) (clamped into [0, T)). It
// starts from states[read[r]] when 0 <= read[r] < M, else from zeros, and its final state goes to states[write[r]]
// when 0 <= write[r] < M (of two requests writing one slot, the later one's stays), else nowhere. Requests without
// tokens read and write nothing. The result states alias the input states (the Python side passes
// input_output_aliases); should XLA hand a separate buffer, the states are copied into it first. Every request
// reads the states as they were before the call, even a slot another request writes.

#ifndef MAXTEXT_KERNELS_CPU_RAGGED_STATE_H_
#define MAXTEXT_KERNELS_CPU_RAGGED_STATE_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace maxtext_cpu {

// Below this much work (tokens x heads x state floats) a call runs on the calling thread alone: waking a helper
// costs more than the work.
constexpr int64_t kMinParallelStateElements = int64_t{1} << 17;

// Runs `step(t, h, before, state, scratch)` for every token t of every request and every head h < heads, in token
// order per (request, head): `before` is the head's state before token t (null: zeros), `state` where the state
// after it goes (`before` itself from the request's second token on), `scratch` `scratch_size` floats of the task's
// own. A head's state is `head_size` floats at offset h * head_size of a slot of heads * head_size floats; `states`
// [slots] of them, updated in place (`src` is the input buffer, `dst` the result's, the same buffer when XLA aliased
// them).
template <typename Step>
void RunRaggedRecurrence(int64_t t_size, int64_t heads, int64_t head_size, int64_t scratch_size, int64_t slots,
                         const int32_t* query_start_loc, const int32_t* read, const int32_t* write, int64_t requests,
                         int32_t num_real, const float* src, float* dst, Step step) {
  const int64_t state_size = heads * head_size;
  if (dst != src) std::memcpy(dst, src, sizeof(float) * slots * state_size);
  const int64_t real = std::clamp<int64_t>(num_real, 0, requests);
  auto valid = [slots](int32_t slot) { return slot >= 0 && slot < slots; };
  // Request r's tokens [begin[r], end[r]), clamped into [0, T).
  std::vector<int64_t> begin(real), end(real);
  for (int64_t r = 0; r < real; ++r) {
    begin[r] = std::clamp<int64_t>(query_start_loc[r], 0, t_size);
    end[r] = std::clamp<int64_t>(query_start_loc[r + 1], begin[r], t_size);
  }
  // A request writes its slot if it has tokens and no later request writes the same slot (the last one stays).
  std::vector<bool> writes(real, false);
  for (int64_t r = 0; r < real; ++r) {
    writes[r] = end[r] > begin[r] && valid(write[r]);
    for (int64_t u = r + 1; u < real && writes[r]; ++u) writes[r] = !(end[u] > begin[u] && write[u] == write[r]);
  }
  // A request reading a slot that another request writes reads a copy taken before any write.
  std::vector<float> before;
  std::vector<int64_t> before_of(real, -1);  // offset of request r's copy in `before`
  for (int64_t r = 0; r < real; ++r) {
    if (end[r] == begin[r] || !valid(read[r])) continue;
    for (int64_t u = 0; u < real; ++u) {
      if (u != r && writes[u] && write[u] == read[r]) {
        before_of[r] = static_cast<int64_t>(before.size());
        before.insert(before.end(), dst + read[r] * state_size, dst + (read[r] + 1) * state_size);
        break;
      }
    }
  }
  auto task = [&](int64_t c) {
    const int64_t r = c / heads, h = c % heads;
    if (end[r] == begin[r]) return;
    const int64_t offset = h * head_size;
    const float* s = nullptr;  // the state before the request's first token (null: zeros)
    if (before_of[r] >= 0) {
      s = before.data() + before_of[r] + offset;
    } else if (valid(read[r])) {
      s = dst + read[r] * state_size + offset;
    }
    // The running state: in the slot the request writes, else in a buffer of its own.
    std::vector<float> own(scratch_size + (writes[r] ? 0 : head_size));
    float* state = writes[r] ? dst + write[r] * state_size + offset : own.data() + scratch_size;
    for (int64_t t = begin[r]; t < end[r]; ++t) step(t, h, t == begin[r] ? s : state, state, own.data());
  };
  const int64_t tasks = real * heads;
  // A task writes only its own (request, head) state, which no other task reads (those read the copies above), so
  // the tasks run in any order.
  if ((end.empty() ? 0 : end.back()) * state_size < kMinParallelStateElements) {
    for (int64_t c = 0; c < tasks; ++c) task(c);
  } else {
    ParallelChunks(tasks, task);
  }
}

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_RAGGED_STATE_H_
