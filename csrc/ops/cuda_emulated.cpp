// Test support (ROPE_EXT_TESTING=1 builds only): runs the CUDA kernel body on
// the CPU. Tests compare its output with the float64 reference, so the CUDA
// indexing, vector paths and grid shapes are checked on machines without a GPU.
#include "cuda_emulated.h"

#include "../rope/cuda_kernel.cuh"
#include "binding.h"

namespace rope_ext {

std::vector<int64_t> cuda_emulated(const at::Tensor& q, const std::optional<at::Tensor>& k,
                                   const at::Tensor& q_out, const std::optional<at::Tensor>& k_out,
                                   const at::Tensor& positions, const at::Tensor& cos_sin,
                                   bool interleaved, bool inverse, int64_t num_sms,
                                   bool force_scalar, int64_t rotary_offset,
                                   at::OptionalIntArrayRef mrope_section, bool mrope_interleaved) {
  const at::Tensor* kp = k.has_value() && k->defined() ? &*k : nullptr;
  const at::Tensor* kop = k_out.has_value() && k_out->defined() ? &*k_out : nullptr;
  TORCH_CHECK_VALUE((kp == nullptr) == (kop == nullptr), "k and k_out must be given together");
  TORCH_CHECK_VALUE(q_out.sizes() == q.sizes() && q_out.dtype() == q.dtype(),
                    "q_out must match q in shape and dtype");
  TORCH_CHECK_VALUE(!kp || (kop->sizes() == kp->sizes() && kop->dtype() == kp->dtype()),
                    "k_out must match k in shape and dtype");
  const auto p = make_params(q, q_out, kp, kop, positions, cos_sin, interleaved, inverse,
                             rotary_offset, mrope_section, mrope_interleaved);
  check_writable(q_out, kop);
  const auto l = rope::gpu::plan_launch(p, num_sms, force_scalar);
  if (rope::gpu::has_work(p, l)) {
    rope::gpu::dispatch_cuda(
        p, l.vectorized, [&]<class T, class CS, class Pos, bool IL, bool Vec>() {
          for (int64_t by = 0; by < l.grid_y; ++by)
            for (int64_t bx = 0; bx < l.grid_x; ++bx)
              for (int64_t ty = 0; ty < l.block_y; ++ty)
                for (int64_t tx = 0; tx < l.block_x; ++tx)
                  rope::gpu::rotary_thread<T, CS, Pos, IL, Vec>(
                      p, l, {bx, by, tx, ty, l.block_x, l.block_y, l.grid_x, l.grid_y});
        });
  }
  return {l.grid_x, l.grid_y, l.block_x, l.block_y, l.vectorized ? 1 : 0};
}

}  // namespace rope_ext
