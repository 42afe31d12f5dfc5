// The per-tap benchmark's bare copy (bench/gpu_bench.py): an XLA FFI handler for CUDA that
// does nothing but what a tap cannot do without, one cudaMemcpyAsync of each operand
// into pinned host memory (cudaHostAlloc, used round-robin) on the computation's
// stream. No ring, no record, no commit, no reader: tapd's CUDA tap is compared with it.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

std::mutex g_mutex;
uint8_t* g_pinned = nullptr;
uint64_t g_bytes = 0;
uint64_t g_offset = 0;

ffi::Error CopyImpl(cudaStream_t stream, ffi::RemainingArgs args) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    if (buffer->element_type() == ffi::DataType::TOKEN) continue;
    uint64_t size = buffer->size_bytes();
    uint8_t* destination;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (size > g_bytes) {
        return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                          "baseline: pinned buffer missing or too small");
      }
      if (g_offset + size > g_bytes) g_offset = 0;
      destination = g_pinned + g_offset;
      g_offset += (size + 63) & ~uint64_t{63};
    }
    cudaError_t err = cudaMemcpyAsync(destination, buffer->untyped_data(), size,
                                      cudaMemcpyDeviceToHost, stream);
    if (err != cudaSuccess) {
      return ffi::Error(ffi::ErrorCode::kInternal, cudaGetErrorString(err));
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaselineCopy, CopyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .RemainingArgs());

extern "C" int baseline_init(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_pinned != nullptr) return 0;
  void* memory = nullptr;
  cudaError_t err = cudaHostAlloc(&memory, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    std::fprintf(stderr, "baseline: cudaHostAlloc(%llu): %s\n",
                 static_cast<unsigned long long>(bytes), cudaGetErrorString(err));
    return 1;
  }
  g_pinned = static_cast<uint8_t*>(memory);
  g_bytes = bytes;
  return 0;
}
