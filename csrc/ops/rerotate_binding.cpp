// Binding of rope_ext::rerotate_kv_cache_: argument checks with user-facing
// messages, the kernel parameters (rope::RerotateParams) and the op body.
#include <torch/headeronly/core/ScalarType.h>

#include "../rope/serving.h"
#include "binding.h"
#include "layout.h"

namespace rope_ext {

using torch::headeronly::ScalarType;

rope::RerotateParams make_rerotate_params(const Tensor& key_cache_t, const Tensor& slot_mapping,
                                          const Tensor& delta, const Tensor& cos_sin,
                                          const std::optional<Tensor>& k_scale, bool interleaved,
                                          const std::string& layout, int64_t rotary_offset) {
  ROPE_CHECK(TypeError, key_cache_t.defined(), "key_cache must be a tensor, got None");
  const Arg kc(key_cache_t);
  ROPE_CHECK(ValueError, layout == "NHD" || layout == "HND", "layout must be 'NHD' or 'HND', got '",
             layout, "'");
  const bool nhd = layout == "NHD";
  ROPE_CHECK(ValueError, kc.dim() == 4, "key_cache must be 4-d ",
             nhd ? "[num_blocks, block_size, Hk, D]" : "[num_blocks, Hk, block_size, D]",
             " (layout='", layout, "'), got shape ", shape_str(kc.sizes()));
  const ScalarType dtype = dtype_of(kc);
  const rope::Fp8 fp8 = fp8_of(dtype);
  ROPE_CHECK(TypeError, is_supported_float(dtype) || fp8 != rope::Fp8::kNone,
             "key_cache must be a float or fp8 tensor (float32, float64, float16, bfloat16, "
             "float8_e4m3fn or float8_e5m2), got ",
             dtype);
  const int64_t D = kc.size(3);
  ROPE_CHECK(ValueError, D <= 1 || kc.stride(3) == 1,
             "key_cache must have a contiguous last dim (stride 1), got strides ",
             shape_str(kc.strides()));
  ROPE_CHECK(ValueError, D <= rope::kMaxHeadDim, "key_cache.shape[-1] (head_dim) must be at most ",
             rope::kMaxHeadDim, ", got ", D);

  ROPE_CHECK(TypeError, slot_mapping.defined(), "slot_mapping must be a tensor, got None");
  ROPE_CHECK(TypeError, dtype_of(slot_mapping) == ScalarType::Long,
             "slot_mapping must be an int64 tensor, got ", dtype_of(slot_mapping));
  ROPE_CHECK(ValueError, slot_mapping.dim() == 1, "slot_mapping must be [T], got shape ",
             shape_str(slot_mapping.sizes()));
  ROPE_CHECK(ValueError, slot_mapping.size(0) <= 1 || slot_mapping.stride(0) == 1,
             "slot_mapping must be contiguous, got strides ", shape_str(slot_mapping.strides()));
  ROPE_CHECK(ValueError, same_device(slot_mapping, kc),
             "slot_mapping must be on the device of key_cache (", device_str(kc), "), got ",
             device_str(slot_mapping));
  const int64_t T = slot_mapping.size(0);

  ROPE_CHECK(TypeError, cos_sin.defined(), "cos_sin must be a tensor, got None");
  // A table, or (the table-free mode) float64 frequencies [rotary_dim]: then delta may be float.
  const bool table_free = cos_sin.dim() == 1;

  ROPE_CHECK(TypeError, delta.defined(), "delta must be a tensor, got None");
  const ScalarType delta_dtype = dtype_of(delta);
  const bool float_delta = delta_dtype == ScalarType::Float || delta_dtype == ScalarType::Double;
  ROPE_CHECK(TypeError,
             delta_dtype == ScalarType::Int || delta_dtype == ScalarType::Long ||
                 (table_free && float_delta),
             "delta must be an int32 or int64 tensor (float32 or float64 with frequencies), got ",
             delta_dtype);
  ROPE_CHECK(ValueError, delta.numel() == 1 || (delta.dim() == 1 && delta.size(0) == T),
             "delta must be [T] (one shift per token of slot_mapping, T = ", T,
             ") or hold one element (one shift for all), got shape ", shape_str(delta.sizes()));
  ROPE_CHECK(ValueError, same_device(delta, kc), "delta must be on the device of key_cache (",
             device_str(kc), "), got ", device_str(delta));

  ROPE_CHECK(ValueError, cos_sin.dim() == 2 || table_free,
             "cos_sin must have shape [positions, rotary_dim] (a table) or [rotary_dim] "
             "(frequencies), got shape ",
             shape_str(cos_sin.sizes()));
  const ScalarType cs_dtype = dtype_of(cos_sin);
  if (table_free)
    ROPE_CHECK(TypeError, cs_dtype == ScalarType::Double,
               "cos_sin of shape [rotary_dim] (frequencies, then factors) must be float64, got ",
               cs_dtype);
  else
    ROPE_CHECK(TypeError, cs_dtype == ScalarType::Float || cs_dtype == dtype,
               "cos_sin must be float32 or the dtype of key_cache (", dtype, "), got ", cs_dtype);
  ROPE_CHECK(ValueError, same_device(cos_sin, kc), "cos_sin must be on the device of key_cache (",
             device_str(kc), "), got ", device_str(cos_sin));
  const int64_t R = cos_sin.size(-1);
  ROPE_CHECK(ValueError, R > 0 && R % 2 == 0,
             "rotary_dim (cos_sin.shape[-1]) must be even and positive, got ", R);
  ROPE_CHECK(ValueError, R <= D, "rotary_dim (cos_sin.shape[-1] = ", R,
             ") must be <= head_dim (key_cache.shape[-1] = ", D, ")");
  ROPE_CHECK(ValueError, rotary_offset >= 0 && rotary_offset <= D - R,
             "rotary_offset must be in [0, head_dim - rotary_dim] = [0, ", D - R, "], got ",
             rotary_offset);
  ROPE_CHECK(ValueError, cos_sin.stride(-1) == 1,
             "cos_sin must have a contiguous last dim, got strides ", shape_str(cos_sin.strides()));
  const float* scale = scale_ptr(k_scale, "k_scale", kc, "key_cache");

  rope::RerotateParams rp{};
  const int64_t NB = kc.size(0), BS = kc.size(nhd ? 1 : 2), Hk = kc.size(nhd ? 2 : 1);
  rp.cache.data = kc.data_ptr();
  rp.cache.block_stride = kc.stride(0);
  rp.cache.row_stride = kc.stride(nhd ? 1 : 2);
  rp.cache.head_stride = kc.stride(nhd ? 2 : 1);
  rp.cache.scale = fp8 != rope::Fp8::kNone ? scale : nullptr;
  rp.fp8 = fp8;
  rp.block_size = BS;
  rp.n_cache_slots = NB * BS;
  rp.slots = static_cast<const int64_t*>(slot_mapping.data_ptr());

  rope::RopeParams& p = rp.rope;
  p.n_tensors = 1;
  p.n_tok_dims = 1;
  p.n_tokens = T;
  p.tok_size[0] = T;
  p.positions = delta.data_ptr();
  p.pos_stride[0] = delta.numel() == 1 ? 0 : delta.stride(0);
  p.pos_int64 = delta_dtype == ScalarType::Long;
  p.pos_type = delta_dtype == ScalarType::Int     ? rope::PosType::kInt32
               : delta_dtype == ScalarType::Long  ? rope::PosType::kInt64
               : delta_dtype == ScalarType::Float ? rope::PosType::kFloat32
                                                  : rope::PosType::kFloat64;
  rope::RotTensor& t = p.t[0];
  t.in = t.out = kc.data_ptr();  // a token's row: its slot's (the kernels add it)
  t.n_head_dims = 1;
  t.n_heads = t.head_size[0] = Hk;
  t.in_head_stride[0] = t.out_head_stride[0] = rp.cache.head_stride;
  p.freqs = table_free ? static_cast<const double*>(cos_sin.data_ptr()) : nullptr;
  p.cos_sin = table_free ? nullptr : cos_sin.data_ptr();
  p.cs_row_stride = table_free ? 0 : cos_sin.stride(0);
  p.n_cache_rows = table_free ? 0 : cos_sin.size(0);
  p.head_dim = int(D);
  p.rotary_dim = int(R);
  p.rot_offset = int(rotary_offset);
  p.interleaved = interleaved;
  // fp8 rows rotate in float32, with a float32 table
  p.x_dtype = fp8 != rope::Fp8::kNone ? rope::DType::kFloat32 : to_dtype(dtype);
  ROPE_CHECK(TypeError, fp8 == rope::Fp8::kNone || table_free || cs_dtype == ScalarType::Float,
             "cos_sin must be float32 for an fp8 key_cache, got ", cs_dtype);
  p.cs_dtype = table_free ? angle_rows_dtype(p) : to_dtype(cs_dtype);

  // The cache is written in place: no element twice, and none of what every thread reads.
  const Layout& lc = kc.layout();
  check_no_self_overlap(lc, "key_cache");
  const Layout none;
  const Layout ls(slot_mapping), ld(delta), lcs(cos_sin);
  const Layout lsc = scale ? Layout(*k_scale) : none;
  for (const auto& [r, rn] :
       {std::pair{&ls, "slot_mapping"}, {&ld, "delta"}, {&lcs, "cos_sin"}, {&lsc, "k_scale"}})
    check_disjoint(lc, "key_cache", *r, rn);
  return rp;
}

void rerotate_kv_cache_(const Backend& backend, const Tensor& key_cache, const Tensor& slot_mapping,
                        const Tensor& delta, const Tensor& cos_sin,
                        const std::optional<Tensor>& k_scale, bool interleaved,
                        const std::string& layout, int64_t rotary_offset) {
  auto rp = make_rerotate_params(key_cache, slot_mapping, delta, cos_sin, k_scale, interleaved,
                                 layout, rotary_offset);
  const rope::RopeParams& p = rp.rope;
  if (p.n_tokens == 0 || p.t[0].n_heads == 0) return;
  // Frequencies: each token's row of its own delta (signed, so never inverse), then as a table.
  const auto rows = bind_angle_rows(rp.rope, key_cache, backend.launch_rows, backend.host_scratch);
  if (backend.check_positions) {
    // A backend that reads host memory checks slots and shifts before any write.
    check_slots(rp.slots, p.n_tokens, rp.n_cache_slots, "each cached key is shifted once per call");
    for (int64_t t = 0; t < p.n_tokens; ++t) {
      if (rp.slots[t] < 0) continue;
      const int64_t off = t * p.pos_stride[0];
      const int64_t d =
          p.pos_int64 ? rope::load_position<int64_t>(p, off) : rope::load_position<int32_t>(p, off);
      bool inverse = false;
      ROPE_CHECK(std::out_of_range, rope::shift_row(d, p.n_cache_rows, inverse) >= 0,
                 "delta must be in (-cos_sin.shape[0], cos_sin.shape[0]) = (-", p.n_cache_rows,
                 ", ", p.n_cache_rows, "), got ", d, " for token ", t);
    }
  }
  backend.launch_rerotate(rp, key_cache);
}

}  // namespace rope_ext
