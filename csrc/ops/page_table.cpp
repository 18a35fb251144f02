// The page table of the cache writes (FlashInfer's append_paged_kv_cache
// arguments): its checks, its kernel parameters, the host check of every
// token's slot, and rope_ext::_page_table_slots.
#include <torch/csrc/stable/ops.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <vector>

#include "../rope/serving.h"
#include "binding.h"
#include "layout.h"

namespace rope_ext {

using torch::headeronly::ScalarType;

namespace {

// The page table's tensors, in page_table's order (which is rope::PageTable's).
constexpr const char* kNames[5] = {"batch_indices", "positions", "kv_indices", "kv_indptr",
                                   "kv_last_page_len"};

int64_t at(const rope::PageTable& pt, const void* x, int which, int64_t i) {
  return rope::page_index(pt, x, which, i);
}

}  // namespace

rope::PageTable page_table_params(const std::vector<Tensor>& pt, const Arg& x, const char* x_name,
                                  int64_t n_tokens, int64_t n_blocks) {
  ROPE_CHECK(ValueError, pt.size() == 4 || pt.size() == 5,
             "page_table must be (batch_indices, positions, kv_indices, kv_indptr) or (..., "
             "kv_last_page_len), got ",
             pt.size(), " tensors");
  rope::PageTable p{};
  const void* data[5] = {};
  for (size_t i = 0; i < pt.size(); ++i) {
    const Tensor& t = pt[i];
    const char* name = kNames[i];
    const ScalarType dt = dtype_of(t);
    ROPE_CHECK(TypeError, dt == ScalarType::Int || dt == ScalarType::Long, "page_table's ", name,
               " must be an int32 or int64 tensor, got ", dt);
    ROPE_CHECK(ValueError, t.dim() == 1, "page_table's ", name, " must be 1-d, got shape ",
               shape_str(t.sizes()));
    ROPE_CHECK(ValueError, t.size(0) <= 1 || t.stride(0) == 1, "page_table's ", name,
               " must be contiguous, got strides ", shape_str(t.strides()));
    ROPE_CHECK(ValueError, same_device(t, x), "page_table's ", name, " must be on the device of ",
               x_name, " (", device_str(x), "), got ", device_str(t));
    if (dt == ScalarType::Long) p.int64_mask |= 1u << i;
    data[i] = t.data_ptr();
  }
  const int64_t n = pt[0].size(0);
  ROPE_CHECK(ValueError, n <= n_tokens && pt[1].size(0) == n,
             "page_table's batch_indices and positions must be [T'] with T' <= T = ", n_tokens,
             ", got shapes ", shape_str(pt[0].sizes()), " and ", shape_str(pt[1].sizes()));
  ROPE_CHECK(ValueError, pt[3].size(0) >= 1,
             "page_table's kv_indptr must be [batch_size + 1], got shape ",
             shape_str(pt[3].sizes()));
  const int64_t batch = pt[3].size(0) - 1;
  if (pt.size() == 5)
    ROPE_CHECK(ValueError, pt[4].size(0) == batch,
               "page_table's kv_last_page_len must be [batch_size] = [", batch,
               "] (kv_indptr is [batch_size + 1]), got shape ", shape_str(pt[4].sizes()));
  p.batch = data[0];
  p.pos = data[1];
  p.indices = data[2];
  p.indptr = data[3];
  p.last_len = data[4];
  p.n_tokens = n;
  p.n_indices = pt[2].size(0);
  p.batch_size = batch;
  p.n_blocks = n_blocks;
  return p;
}

std::vector<int64_t> page_table_slots(const rope::PageTable& pt, int64_t block_size) {
  std::vector<int64_t> slots(size_t(pt.n_tokens), -1);
  for (int64_t t = 0; t < pt.n_tokens; ++t) {
    const rope::PageSlot s = rope::page_slot(pt, block_size, t);
    const int64_t b = s.b >= 0 ? s.b : at(pt, pt.batch, 0, t);
    switch (s.fault) {
      case rope::PageFault::kNone:
      case rope::PageFault::kSkipped:
        break;
      case rope::PageFault::kBatch:
        ROPE_CHECK(std::out_of_range, false, "page_table's batch_indices[", t, "] = ", b,
                   " must be -1 or in [0, batch_size) = [0, ", pt.batch_size, ")");
        break;
      case rope::PageFault::kIndptr:
        ROPE_CHECK(std::out_of_range, false, "page_table's kv_indptr[", b, "], kv_indptr[", b + 1,
                   "] = ", at(pt, pt.indptr, 3, b), ", ", at(pt, pt.indptr, 3, b + 1),
                   " (the pages of request ", b, ", token ", t,
                   ") must be in order within [0, kv_indices.numel()] = [0, ", pt.n_indices, "]");
        break;
      case rope::PageFault::kLastLen:
        ROPE_CHECK(ValueError, false, "page_table's kv_last_page_len[", b,
                   "] = ", at(pt, pt.last_len, 4, b), " must be in [0, page_size] = [0, ",
                   block_size, "]");
        break;
      case rope::PageFault::kPosition: {
        const int64_t pages = at(pt, pt.indptr, 3, b + 1) - at(pt, pt.indptr, 3, b);
        ROPE_CHECK(std::out_of_range, false, "page_table's positions[", t,
                   "] = ", at(pt, pt.pos, 1, t), " is outside request ", b, " (", pages,
                   " pages of ", block_size, " rows",
                   pt.last_len ? ", the last holding kv_last_page_len = " : "",
                   pt.last_len ? str(at(pt, pt.last_len, 4, b)) : "", ")");
        break;
      }
      case rope::PageFault::kPage:
        ROPE_CHECK(std::out_of_range, false, "page_table's kv_indices[", s.page,
                   "] = ", at(pt, pt.indices, 2, s.page), " (token ", t,
                   ") must be a page of the cache, in [0, num_blocks) = [0, ", pt.n_blocks, ")");
        break;
    }
    slots[size_t(t)] = s.slot;
  }
  return slots;
}

Tensor page_table_slots_op(std::vector<Tensor> page_table, int64_t block_size, int64_t num_blocks) {
  ROPE_CHECK(ValueError, !page_table.empty(), "page_table must hold 4 or 5 tensors, got 0");
  ROPE_CHECK(ValueError,
             block_size >= 0 && num_blocks >= 0 &&
                 (num_blocks == 0 || block_size <= INT64_MAX / num_blocks),
             "block_size and num_blocks must be non-negative, their product an int64, got ",
             block_size, ", ", num_blocks);
  const Arg first(page_table[0]);
  const auto pt =
      page_table_params(page_table, first, "batch_indices",
                        page_table[0].dim() == 1 ? page_table[0].size(0) : 0, num_blocks);
  const std::vector<int64_t> slots = page_table_slots(pt, block_size);
  check_slots(slots.data(), int64_t(slots.size()), num_blocks * block_size,
              "each token's k and v need a slot of their own", "page_table");
  Tensor out = torch::stable::new_empty(page_table[0], {int64_t(slots.size())},
                                        std::make_optional(ScalarType::Long));
  auto* o = static_cast<int64_t*>(out.data_ptr());
  for (size_t i = 0; i < slots.size(); ++i) o[i] = slots[i];
  return out;
}

}  // namespace rope_ext
