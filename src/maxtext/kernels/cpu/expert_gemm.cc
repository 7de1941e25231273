// Routed experts' products for XLA on x86-64 CPUs with AVX2 and FMA, as XLA FFI handlers:
//
//   maxtext_expert_gemm:      y[r] = x[r] @ w[experts[r]]  (w [E, K, N], one matrix per expert, read where it lies)
//   maxtext_expert_gemm_many: y_i[r] = x[r] @ w_i[experts[r]] for several w_i  (an expert's gate and up in one call)
//
// for any number of float32 rows, grouped by expert into chunks of up to 8 (one read of the matrix per chunk; XLA
// would copy every selected matrix out of w first). The chunks run on gemm_rows.h's routines, cut into tasks
// shared by the calling thread and the library's helper threads (parallel.h); partial sums are combined in a fixed
// order, so a result does not depend on the threads.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gemm_rows.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using maxtext_cpu::AddSlices;
using maxtext_cpu::Align32;
using maxtext_cpu::AlignedRows;
using maxtext_cpu::kLanes;
using maxtext_cpu::NNAccumulate;
using maxtext_cpu::NNStore;
using maxtext_cpu::ParallelChunks;
using maxtext_cpu::RowAccumulate;

namespace {

// Columns per block of an expert product (a task's buffer of 8 lanes per column stays in the L2 cache).
constexpr int64_t kMaxExpertColumns = 2048;
// The expert kernel splits the rows of w into slices until it has kMinExpertTasks tasks, slices of at least
// kMinExpertSlice rows.
constexpr int64_t kMinExpertTasks = 4;
constexpr int64_t kMinExpertSlice = 64;

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
    col_blocks_ = (n + kMaxExpertColumns - 1) / kMaxExpertColumns;
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
    alignas(32) float local[kMaxExpertColumns * kLanes];
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
