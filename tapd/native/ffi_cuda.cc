// tapd's XLA FFI handler for the CUDA platform. XLA calls it on the host when the
// computation's stream reaches the tap, with device pointers to the operands. It
// reserves the record in the ring (on the host, now), enqueues a cudaMemcpyAsync of
// each operand, and of the step straight into the record header's `step` field, on
// the computation's own stream, then a cudaLaunchHostFunc that commits the record once
// those copies are done. Nothing waits: not the host (no synchronisation) and not the
// stream (beyond the commit, a few atomic stores; never Python). Records of several
// streams commit in whatever order their streams get there (ring.h, commit tags).
//
// The ring memory is registered with cudaHostRegister once, at the first tap into it,
// so the copies are DMA into pinned memory. A copy never targets the ring's second
// mapping: one that would cross the ring's end is split in two.
//
// Built apart from the ring's library (it needs the CUDA runtime: headers and
// libcudart from pip's nvidia-cuda-runtime-cu12; no nvcc, no kernels), so that a
// machine without CUDA never needs libcudart to load the ring. It writes through the
// ring library's table (tapd_ring_internal_api), handed over by tapd_cuda_attach.

#include <cuda_runtime_api.h>
#include <time.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "ring.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

const tapd::RingApi* g_api = nullptr;

struct Registration {
  void* ring;
  uint8_t* base;
  uint64_t capacity;
  uint64_t registered;  // bytes pinned from `base`: 2 * capacity, capacity, or 0
};

std::mutex g_mutex;
std::unordered_map<void*, std::unique_ptr<Registration>> g_registered;  // by ring
std::atomic<Registration*> g_last{nullptr};  // the last one looked up: the fast path
std::atomic<bool> g_warned{false};

void Unregister(void* ring) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto found = g_registered.find(ring);
  if (found == g_registered.end()) return;
  Registration* r = found->second.get();
  if (r->registered) {
    cudaHostUnregister(r->base);
    cudaGetLastError();  // (at exit the runtime may be gone already: nothing to do)
  }
  g_last.compare_exchange_strong(r, nullptr);
  g_registered.erase(found);
}

// Pin the ring's record area, both mappings in one registration if the driver takes
// it, else the first one alone (copies never use the second). Once per ring.
Registration Registered(void* ring) {
  Registration* last = g_last.load(std::memory_order_acquire);
  if (last != nullptr && last->ring == ring) return *last;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::unique_ptr<Registration>& slot = g_registered[ring];
  if (slot == nullptr) {
    auto r = std::make_unique<Registration>(Registration{ring, nullptr, 0, 0});
    r->base = g_api->records(ring, &r->capacity);
    if (cudaHostRegister(r->base, 2 * r->capacity, cudaHostRegisterPortable) == cudaSuccess) {
      r->registered = 2 * r->capacity;
    } else {
      cudaGetLastError();
      cudaError_t err = cudaHostRegister(r->base, r->capacity, cudaHostRegisterPortable);
      if (err == cudaSuccess) {
        r->registered = r->capacity;
      } else {
        cudaGetLastError();
        if (!g_warned.exchange(true)) {
          std::fprintf(stderr,
                       "tapd: cudaHostRegister of the tap ring failed (%s); device copies "
                       "into it will not be asynchronous\n",
                       cudaGetErrorString(err));
        }
      }
    }
    g_api->set_close_hook(ring, Unregister);
    slot = std::move(r);
  }
  g_last.store(slot.get(), std::memory_order_release);
  return *slot;
}

// Copy `size` bytes from the device to ring position `position` on `stream`, split in
// two where it would cross the end of the ring.
cudaError_t CopyToRing(const Registration& r, uint64_t position, const void* source,
                       uint64_t size, cudaStream_t stream) {
  uint64_t at = position % r.capacity;
  uint64_t first = size < r.capacity - at ? size : r.capacity - at;
  cudaError_t err = cudaMemcpyAsync(r.base + at, source, first, cudaMemcpyDefault, stream);
  if (err != cudaSuccess || first == size) return err;
  return cudaMemcpyAsync(r.base, static_cast<const uint8_t*>(source) + first, size - first,
                         cudaMemcpyDefault, stream);
}

struct Pending {
  void* ring;
  uint64_t position;
};

int64_t RealtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

// Host functions: run by the CUDA driver once the stream's earlier work (our copies)
// is done. They must not call CUDA; they do not.
void CommitOnHost(void* data) {
  auto* pending = static_cast<Pending*>(data);
  g_api->commit(pending->ring, pending->position, RealtimeNs());  // the time the value was copied
  g_api->unhold(pending->ring);
  delete pending;
}

void AbandonOnHost(void* data) {
  auto* pending = static_cast<Pending*>(data);
  g_api->abandon(pending->ring, pending->position);
  g_api->unhold(pending->ring);
  delete pending;
}

ffi::Error TapCudaImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                       ffi::RemainingRets /*token*/, int64_t site, int64_t consumer,
                       int64_t has_step) {
  if (g_api == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tapd: the CUDA tap handler was not attached to the ring library");
  }
  void* ring = g_api->installed();
  if (ring == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tapd: native tap ran before the emitter attached its ring");
  }
  Registration registration = Registered(ring);
  // The operands: the leaves, then the step if there is one. An ordered tap's token
  // comes as an argument too (a TOKEN buffer): it is no leaf.
  size_t nleaves = 0;
  uint64_t length = sizeof(tapd::RecordHeader);
  const void* step_data = nullptr;
  uint64_t step_bytes = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    if (buffer->element_type() == ffi::DataType::TOKEN) continue;
    ++nleaves;
    length += tapd::Align8(buffer->size_bytes());
    step_data = buffer->untyped_data();
    step_bytes = buffer->size_bytes();
  }
  if (has_step) {  // the last operand
    if (nleaves == 0 || (step_bytes != 4 && step_bytes != 8)) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "tapd: a tap's step must be one 32- or 64-bit integer");
    }
    --nleaves;
    length -= tapd::Align8(step_bytes);
  }
  uint64_t position;
  g_api->hold(ring);
  // The step is copied in by the device: zero until then (a 4-byte one lands in the
  // low half and the commit sign-extends it).
  uint8_t* out = g_api->begin(ring, length, uint64_t(site), uint32_t(consumer), device,
                              uint32_t(nleaves), has_step ? 0 : tapd::kNoStep,
                              has_step && step_bytes == 4 ? tapd::kFlagStep32 : 0,
                              &position);
  if (out == nullptr) {  // dropped, and counted
    g_api->unhold(ring);
    return ffi::Error::Success();
  }
  cudaError_t err = cudaSuccess;
  uint64_t offset = sizeof(tapd::RecordHeader);
  size_t leaf = 0;
  for (size_t i = 0; i < args.size() && leaf < nleaves && err == cudaSuccess; ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer->element_type() == ffi::DataType::TOKEN) continue;
    uint64_t size = buffer->size_bytes();
    if (size) {
      err = CopyToRing(registration, position + offset, buffer->untyped_data(), size, stream);
    }
    offset += tapd::Align8(size);
    ++leaf;
  }
  if (err == cudaSuccess && has_step) {
    err = CopyToRing(registration, position + offsetof(tapd::RecordHeader, step), step_data,
                     step_bytes, stream);
  }
  if (err == cudaSuccess) {
    auto* pending = new Pending{ring, position};
    err = cudaLaunchHostFunc(stream, CommitOnHost, pending);
    if (err == cudaSuccess) return ffi::Error::Success();
    delete pending;
  }
  // Something failed after the reservation. Copies already enqueued may still land in
  // the record: give it up only after them (a stream runs its work in order), so that
  // its space is never reused under a late copy.
  std::string message = std::string("tapd: CUDA tap failed: ") + cudaGetErrorString(err);
  cudaGetLastError();
  auto* pending = new Pending{ring, position};
  if (cudaLaunchHostFunc(stream, AbandonOnHost, pending) != cudaSuccess) {
    delete pending;
    cudaStreamSynchronize(stream);  // the error path only
    cudaGetLastError();
    g_api->abandon(ring, position);
    g_api->unhold(ring);
  }
  return ffi::Error(ffi::ErrorCode::kInternal, message);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TapdTapCuda, TapCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()  // an ordered tap's token (jaxlib < 0.10 passes it)
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("consumer")
                                  .Attr<int64_t>("has_step"));

extern "C" {

// Attach to the ring library (its tapd_ring_internal_api(kApiVersion) table): the
// handler then writes to that library's installed ring. 0 on success, 1 if the table
// is missing or of another version (a ring library built from other sources).
int tapd_cuda_attach(const void* api) {
  const auto* table = static_cast<const tapd::RingApi*>(api);
  if (table == nullptr || table->version != tapd::kApiVersion ||
      table->size != sizeof(tapd::RingApi)) {
    return 1;
  }
  g_api = table;
  return 0;
}

// The XLA FFI API version this handler was compiled against (major << 16 | minor): a
// jaxlib of the same major version and at least this minor runs it.
uint32_t tapd_ffi_api_version_cuda() {
  return (uint32_t{XLA_FFI_API_MAJOR} << 16) | uint32_t{XLA_FFI_API_MINOR};
}

// The CUDA runtime version this library runs with (e.g. 12090), or -1.
int tapd_cuda_runtime_version() {
  int version = -1;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return -1;
  return version;
}

}  // extern "C"
