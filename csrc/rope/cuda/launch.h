// The CUDA kernel's entry point. Torch-free: needs only the CUDA runtime
// headers. csrc/ops/ops_cuda.cu calls it under a device guard on the current
// stream.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.h"

namespace rope {
namespace gpu {

// Rotates every token of `p` with one kernel launch on `stream`.
//
//   p        the tensors, positions and cos/sin table (params.h); every
//            pointer is device memory of the current device. Positions are
//            not checked on the host: a position outside the cache reads
//            nothing and makes that token's rotated features NaN.
//   num_sms  streaming multiprocessors of the device (cudaDevAttr
//            MultiProcessorCount); only the grid shape depends on it.
//   stream   the stream to launch on.
//
// Returns cudaSuccess, or the launch error (cudaGetLastError after the
// launch). Enqueues at most one kernel and nothing else: no synchronisation,
// no allocation, so the call can be captured in a CUDA graph. An empty
// problem (no token, no head) launches nothing.
cudaError_t launch(const RopeParams& p, int num_sms, cudaStream_t stream);

// RoPE + KV-cache write (cuda/serving.cuh: cache_thread) in one launch. A slot
// outside the cache is skipped (never written); the scales are read on the device.
cudaError_t launch_cache(const CacheParams& p, int num_sms, cudaStream_t stream);

// Re-rotation of cached keys (cuda/rerotate.cuh) in one launch. A slot outside
// the cache, or a delta no table row holds, leaves that token's row unchanged.
cudaError_t launch_rerotate(const RerotateParams& p, int num_sms, cudaStream_t stream);

// QK-RMSNorm + rotary (cuda/serving.cuh: norm_phase1/2) in one launch.
cudaError_t launch_norm(const NormParams& p, int num_sms, cudaStream_t stream);

// The table-free rows (cuda/angles.cuh) in one launch: every token's row of
// ar.rows (and ar.index). A position whose angle cannot be formed gives a NaN row.
cudaError_t launch_angle_rows(const AngleRows& ar, int num_sms, cudaStream_t stream);

}  // namespace gpu
}  // namespace rope
