// tapd's XLA FFI handler for the CUDA platform. XLA calls it on the host when the
// computation's stream reaches the tap, with device pointers to the operands. It
// reserves the record in the ring (on the host, now), enqueues a cudaMemcpyAsync of
// each operand, and of the step straight into the record header's `step` field, on
// the computation's own stream, then the record's commit, ordered after those copies.
// Nothing waits: not the host (no synchronisation) and not the stream. Records of
// several streams commit in whatever order their streams get there (ring.h).
//
// The commit, one of three (CommitVariant, chosen per device; `tapd doctor` says which):
// - stream write: the stream itself stores the commit tag into the ring, with
//   cuStreamWriteValue32 (the driver's, reached through cudaGetDriverEntryPoint: no link
//   to libcuda) at the ring's device mapping. No host code runs; the reader polls for
//   the tag (tapd_ring_sleep). Data before flag: the copies and the write are ordered on
//   one stream, and the write's default flags put a memory barrier before it.
// - side-stream host function: an event recorded on the computation's stream, a side
//   stream waiting for it, and a cudaLaunchHostFunc on the side stream that commits: the
//   computation's stream never waits for the host. Where stream memory operations are
//   not supported (CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS), or the ring could not be
//   mapped for the device.
// - host function: a cudaLaunchHostFunc on the computation's stream (tapd's first
//   design: a stream->host->stream round trip per tap). Only when asked for
//   (TAPD_CUDA_COMMIT=host) or when a side stream cannot be made.
// TAPD_CUDA_COMMIT=stream|side|host picks one (the benchmark compares them); where the
// one asked for cannot be had, the next one down is used, and the reason says so.
//
// The ring's record area is registered with cudaHostRegister (portable, mapped) when
// the ring is installed (tapd_ring_install calls this library's hook), never inside a
// tap; so the copies are DMA into pinned memory. A copy never targets the ring's
// second mapping: one that would cross the ring's end is split in two; a tag is
// written at its offset in the first mapping.
//
// Built apart from the ring's library (it needs the CUDA runtime: headers and
// libcudart from pip's nvidia-cuda-runtime-cu12; no nvcc, no kernels), so that a
// machine without CUDA never needs libcudart to load the ring. It writes through the
// ring library's table (tapd_ring_internal_api), handed over by tapd_cuda_attach.

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "ring.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

const tapd::RingApi* g_api = nullptr;

// ---- The driver entry points (declared here: no cuda.h needed, no libcuda linked) ----

using CUresult = int;  // CUDA_SUCCESS is 0
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using StreamWriteValue32 = CUresult (*)(cudaStream_t, CUdeviceptr, uint32_t, unsigned int);
using DeviceGet = CUresult (*)(CUdevice*, int);
using DeviceGetAttribute = CUresult (*)(int*, int, CUdevice);
constexpr int kAttrCanUseStreamMemOps = 92;  // CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS(_V1)
constexpr unsigned int kWriteValueDefault = 0;  // CU_STREAM_WRITE_VALUE_DEFAULT: a barrier first

// A driver function by name, or nullptr (and why).
void* DriverSymbol(const char* name, std::string* why) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &function, 12000,
                                                     cudaEnableDefault, &found);
#else
  cudaError_t err = cudaGetDriverEntryPoint(name, &function, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || function == nullptr) {
    if (why != nullptr) {
      *why = std::string("the driver has no ") + name + " (" +
             (err != cudaSuccess ? cudaGetErrorString(err) : "symbol not found") + ")";
    }
    cudaGetLastError();
    return nullptr;
  }
  return function;
}

StreamWriteValue32 g_write32 = nullptr;  // set once a device chose the stream write

// ---- Which commit a device gets -----------------------------------------------------

enum CommitVariant : int { kCommitHost = 0, kCommitSide = 1, kCommitStream = 2 };

const char* VariantName(int variant) {
  switch (variant) {
    case kCommitStream:
      return "stream write";
    case kCommitSide:
      return "side-stream host function";
    case kCommitHost:
      return "host function";
    default:
      return "none";
  }
}

struct DeviceCommit {
  std::once_flag chosen;
  std::atomic<int> variant{kCommitHost};  // (a refused stream write turns it to kCommitSide)
  std::string why;
  // kCommitSide: the side stream and the event it waits on, made at the first tap.
  std::mutex mutex;  // an event record and the wait on it go together
  bool side_ready = false;
  cudaStream_t side = nullptr;
  cudaEvent_t event = nullptr;
};

constexpr int kMaxDevices = 64;
DeviceCommit g_devices[kMaxDevices];

// Whether a stream write into shared memory registered as the ring is (a MAP_SHARED
// page, pinned and mapped) lands where the host reads it: a sandboxed kernel's GPU proxy
// might not carry it, and a ring whose tags never land would stall for good. Once per
// device, on the thread whose current device it is; a few hundred microseconds.
bool StreamWriteLands(StreamWriteValue32 write32, std::string* why) {
  const size_t kPage = 4096;
  int fd = memfd_create("tapd-probe", MFD_CLOEXEC);
  void* page = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, off_t(kPage)) == 0) {
    page = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  if (fd >= 0) close(fd);
  if (page == MAP_FAILED) {
    page = mmap(nullptr, kPage, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  }
  if (page == MAP_FAILED) {
    *why = "no page to test the stream write on";
    return false;
  }
  auto* word = static_cast<volatile uint32_t*>(page);
  *word = 0;
  constexpr uint32_t kValue = 0x7a9d0001;
  bool landed = false;
  void* device = nullptr;
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaHostRegister(page, kPage, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err == cudaSuccess) {
    if ((err = cudaHostGetDevicePointer(&device, page, 0)) == cudaSuccess &&
        (err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)) == cudaSuccess) {
      CUresult r = write32(stream, reinterpret_cast<CUdeviceptr>(device), kValue,
                           kWriteValueDefault);
      err = cudaStreamSynchronize(stream);
      for (int i = 0; r == 0 && err == cudaSuccess && i < 1000 && !landed; ++i) {
        landed = *word == kValue;
        if (!landed) usleep(100);
      }
      if (r != 0) *why = "the test write was refused (CUresult " + std::to_string(r) + ")";
      else if (!landed && err == cudaSuccess) *why = "the test write did not land in 100 ms";
      cudaStreamDestroy(stream);
    }
    cudaHostUnregister(page);
  }
  if (err != cudaSuccess) *why = std::string("cannot test the stream write: ") + cudaGetErrorString(err);
  cudaGetLastError();
  munmap(page, kPage);
  return landed;
}

// What `device` supports, and what TAPD_CUDA_COMMIT asks for: the variant, and why.
void Choose(int device, DeviceCommit* d) {
  const char* asked = std::getenv("TAPD_CUDA_COMMIT");
  std::string wanted = asked != nullptr && *asked ? asked : "auto";
  if (wanted == "host") {
    d->variant = kCommitHost;
    d->why = "TAPD_CUDA_COMMIT=host";
    return;
  }
  if (wanted != "auto" && wanted != "stream" && wanted != "side") {
    d->why = "TAPD_CUDA_COMMIT=" + wanted + " is not one of auto, stream, side, host; ";
    wanted = "auto";
  }
  if (wanted == "side") {
    d->variant = kCommitSide;
    d->why += "TAPD_CUDA_COMMIT=side";
    return;
  }
  std::string missing;
  auto write32 = reinterpret_cast<StreamWriteValue32>(DriverSymbol("cuStreamWriteValue32", &missing));
  auto get = reinterpret_cast<DeviceGet>(DriverSymbol("cuDeviceGet", &missing));
  auto attribute =
      reinterpret_cast<DeviceGetAttribute>(DriverSymbol("cuDeviceGetAttribute", &missing));
  int driver = 0;
  cudaDriverGetVersion(&driver);
  char detail[160];
  if (write32 == nullptr || get == nullptr || attribute == nullptr) {
    d->variant = kCommitSide;
    d->why += "stream memory operations unavailable: " + missing;
    return;
  }
  CUdevice handle = 0;
  int attribute_value = -1;
  CUresult got = get(&handle, device);
  CUresult queried = got == 0 ? attribute(&attribute_value, kAttrCanUseStreamMemOps, handle) : got;
  // Since CUDA 12 the (v2) stream memory operations are always there, and the attribute
  // only speaks of the v1 API; before, it says. (A write the device still refuses
  // turns the device to the side stream at its first tap: EnqueueCommit.)
  bool supported = driver >= 12000 || (queried == 0 && attribute_value == 1);
  if (queried == 0) {
    std::snprintf(detail, sizeof(detail),
                  "driver %d.%d, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS=%d",
                  driver / 1000, driver % 1000 / 10, attribute_value);
  } else {
    std::snprintf(detail, sizeof(detail),
                  "driver %d.%d, CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS not answered "
                  "(error %d)", driver / 1000, driver % 1000 / 10, queried);
  }
  if (!supported) {
    d->variant = kCommitSide;
    d->why += std::string("stream memory operations not supported (") + detail + ")";
    return;
  }
  std::string refused;
  if (!StreamWriteLands(write32, &refused)) {
    d->variant = kCommitSide;
    d->why += "a stream write into mapped shared memory does not work here: " + refused +
              " (" + detail + ")";
    return;
  }
  g_write32 = write32;
  d->variant = kCommitStream;
  d->why += std::string("cuStreamWriteValue32 into the mapped ring, tested (") + detail + ")";
}

DeviceCommit* Device(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  DeviceCommit* d = &g_devices[device];
  std::call_once(d->chosen, [&] { Choose(device, d); });
  return d;
}

// The side stream and event of `d`, made on first use (on the tap's thread, whose
// current device XLA has set; under d->mutex). False if they cannot be made: then the
// host function on the computation's stream.
bool SideReady(DeviceCommit* d) {
  if (d->side_ready) return true;
  if (d->side == nullptr && cudaStreamCreateWithFlags(&d->side, cudaStreamNonBlocking) != cudaSuccess) {
    d->side = nullptr;
  }
  if (d->event == nullptr &&
      cudaEventCreateWithFlags(&d->event, cudaEventDisableTiming) != cudaSuccess) {
    d->event = nullptr;
  }
  cudaGetLastError();
  d->side_ready = d->side != nullptr && d->event != nullptr;
  return d->side_ready;
}

// ---- The ring's registration with CUDA ----------------------------------------------

struct Registration {
  void* ring;
  uint8_t* base;
  uint64_t capacity;
  uint64_t registered;      // bytes pinned from `base`: capacity, or 0
  CUdeviceptr device_base;  // `base` as the device sees it (mapped), or 0
  double seconds;           // how long cudaHostRegister took
};

std::mutex g_mutex;
std::unordered_map<void*, std::unique_ptr<Registration>> g_registered;  // by ring
std::atomic<Registration*> g_last{nullptr};  // the last one looked up: the fast path

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

bool Pin(Registration* r, uint64_t bytes, unsigned int flags, cudaError_t* err) {
  *err = cudaHostRegister(r->base, bytes, flags);
  if (*err != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  r->registered = bytes;
  return true;
}

// Pin the ring's record area, mapped for the devices; unmapped if mapped is refused.
// Its first mapping only: copies and tags never target the second, and pinning both
// (the same pages twice over) doubles what is pinned, and what a sandboxed kernel's
// GPU proxy has to make of aliased pages. Once per ring.
Registration Registered(void* ring) {
  Registration* last = g_last.load(std::memory_order_acquire);
  if (last != nullptr && last->ring == ring) return *last;
  std::lock_guard<std::mutex> lock(g_mutex);
  std::unique_ptr<Registration>& slot = g_registered[ring];
  if (slot == nullptr) {
    auto r = std::make_unique<Registration>(Registration{ring, nullptr, 0, 0, 0, 0});
    r->base = g_api->records(ring, &r->capacity);
    auto started = std::chrono::steady_clock::now();
    const unsigned int mapped = cudaHostRegisterPortable | cudaHostRegisterMapped;
    cudaError_t err = cudaSuccess;
    if (Pin(r.get(), r->capacity, mapped, &err)) {
      void* device = nullptr;
      if (cudaHostGetDevicePointer(&device, r->base, 0) == cudaSuccess) {
        r->device_base = reinterpret_cast<CUdeviceptr>(device);
      }
      cudaGetLastError();
    } else if (cudaError_t mapping = err;
               Pin(r.get(), r->capacity, cudaHostRegisterPortable, &err)) {
      std::fprintf(stderr,
                   "tapd: the tap ring could not be mapped for the GPU (%s): its taps "
                   "commit with a side-stream host function, not from the stream\n",
                   cudaGetErrorString(mapping));
    } else {
      std::fprintf(stderr,
                   "tapd: cudaHostRegister of the tap ring failed (%s); device copies "
                   "into it will not be asynchronous\n",
                   cudaGetErrorString(err));
    }
    r->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (r->seconds > 1.0) {
      std::fprintf(stderr, "tapd: registering the %llu MiB tap ring with CUDA took %.1f s\n",
                   static_cast<unsigned long long>(r->capacity >> 20), r->seconds);
    }
    g_api->set_close_hook(ring, Unregister);
    slot = std::move(r);
  }
  g_last.store(slot.get(), std::memory_order_release);
  return *slot;
}

// The install hook: register now, where there is a device to register it for (a
// process that loaded this library without a GPU, `tapd doctor` say, does nothing).
void RegisterInstalled(void* ring) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    return;
  }
  Registered(ring);
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

// Enqueue the commit of the record at `position` (`length` bytes), after the copies
// already enqueued on `stream`.
cudaError_t EnqueueCommit(void* ring, const Registration& registration, DeviceCommit* d,
                          uint64_t position, uint64_t length, cudaStream_t stream) {
  // (A stream write that fails to enqueue leaves its record to the error path, which
  // abandons it after the copies: it never commits on the host with kFlagDeviceCommit.)
  int variant = d != nullptr ? d->variant.load(std::memory_order_relaxed) : kCommitHost;
  if (variant == kCommitStream && registration.device_base == 0) variant = kCommitSide;
  if (variant == kCommitStream) {  // (its record was begun with kFlagDeviceCommit)
    uint64_t offset;
    uint64_t tag = g_api->commit_tag(ring, position, &offset);
    CUresult r = g_write32(stream, registration.device_base + offset, uint32_t(tag),
                           kWriteValueDefault);
    if (r == 0) {
      g_api->device_commit_enqueued(ring, position, length);
      g_api->unhold(ring);  // (close now waits on the tag itself)
      return cudaSuccess;
    }
    // Refused (CUDA_ERROR_NOT_SUPPORTED, say): nothing was enqueued. This record and
    // the device's next ones commit from a side stream (a host commit clears the flag).
    if (d->variant.exchange(kCommitSide) == kCommitStream) {
      std::fprintf(stderr,
                   "tapd: cuStreamWriteValue32 into the tap ring failed (CUresult %d): "
                   "CUDA taps commit with a side-stream host function from now on\n", r);
      std::lock_guard<std::mutex> lock(d->mutex);
      d->why += "; but the device refused the write (CUresult " + std::to_string(r) + ")";
    }
    variant = kCommitSide;
  }
  auto* pending = new Pending{ring, position};
  cudaError_t err = cudaErrorNotReady;
  if (variant == kCommitSide) {
    std::lock_guard<std::mutex> lock(d->mutex);
    if (SideReady(d)) {
      err = cudaEventRecord(d->event, stream);
      if (err == cudaSuccess) err = cudaStreamWaitEvent(d->side, d->event, 0);
      if (err == cudaSuccess) err = cudaLaunchHostFunc(d->side, CommitOnHost, pending);
    }
  }
  if (err == cudaErrorNotReady) {  // the host function on the computation's stream
    err = cudaLaunchHostFunc(stream, CommitOnHost, pending);
  }
  if (err != cudaSuccess) delete pending;
  return err;
}

ffi::Error TapCudaImpl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                       ffi::RemainingRets /*token*/, std::string_view entry,
                       int64_t has_step, int64_t every, int64_t which) {
  if (g_api == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tapd: the CUDA tap handler was not attached to the ring library");
  }
  // The site's ids in this process, by its entry (ring.h, SiteOfEntry).
  uint64_t site = 0;
  uint32_t consumer = 0;
  char error[1024] = {0};
  void* ring = g_api->site_of_entry(int32_t(which), entry.data(), entry.size(), &site,
                                    &consumer, error, sizeof(error));
  if (ring == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, error);
  }
  Registration registration = Registered(ring);  // (registered at install: the fast path)
  DeviceCommit* commit = Device(device);
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
  // low half; a host commit sign-extends it, a reader of a stream-written one does).
  bool by_stream = commit != nullptr && commit->variant == kCommitStream &&
                   registration.device_base != 0;
  uint32_t flags = (has_step && step_bytes == 4 ? tapd::kFlagStep32 : 0) |
                   (by_stream ? tapd::kFlagDeviceCommit : 0);
  // The site table is read here, on the host, as XLA enqueues the tap: a dormant or
  // sampled-out tap (ring.h, SiteSlot) enqueues nothing at all, no copy and no commit.
  uint8_t* out = g_api->begin(ring, length, site, consumer, device,
                              uint32_t(nleaves), has_step ? 0 : tapd::kNoStep, flags,
                              uint64_t(every), &position);
  if (out == nullptr) {  // dropped or skipped, and counted
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
    err = EnqueueCommit(ring, registration, commit, position, length, stream);
    if (err == cudaSuccess) return ffi::Error::Success();
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
                                  // docs/PROTOCOL.md, "The tap's custom call"
                                  .Attr<std::string_view>("entry")
                                  .Attr<int64_t>("has_step")
                                  .Attr<int64_t>("every")
                                  .Attr<int64_t>("ring"));  // kRingDaemon, kRingLocal
// No command-buffer trait (ffi::Traits::kCmdBufferCompatible), on purpose: XLA then
// never captures the tap into a command buffer (CUDA graph), it splits the graph around
// it and calls this handler on the host at every execution. That is what makes the
// dormant/sampled decision above per execution: a captured handler would run its host
// code once, at capture, and its copies would be replayed every step whatever the
// site table said later.

extern "C" {

// Attach to the ring library (its tapd_ring_internal_api(kApiVersion) table): the
// handler then writes to that library's installed ring, which it registers with CUDA
// now (if one is installed) and whenever one is installed. 0 on success, 1 if the table
// is missing or of another version (a ring library built from other sources).
int tapd_cuda_attach(const void* api) {
  const auto* table = static_cast<const tapd::RingApi*>(api);
  if (table == nullptr || table->version != tapd::kApiVersion ||
      table->size != sizeof(tapd::RingApi)) {
    return 1;
  }
  g_api = table;
  g_api->set_install_hook(RegisterInstalled);
  return 0;
}

// The commit that taps on `device` get (0 host function, 1 side-stream host function,
// 2 stream write; -1: no such CUDA device here), and why, into `why` (NUL-terminated).
// A ring that cannot be mapped for the device turns a stream write into a side-stream
// host function (tapd_cuda_ring_registration says whether it was).
int tapd_cuda_commit_variant(int device, char* why, uint64_t why_size) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  std::string reason;
  int variant = -1;
  if (err != cudaSuccess) {
    reason = std::string("no CUDA device here: ") + cudaGetErrorString(err);
    cudaGetLastError();
  } else if (device < 0 || device >= count || device >= kMaxDevices) {
    reason = "no CUDA device " + std::to_string(device) + " here (" + std::to_string(count) +
             " devices)";
  } else {
    DeviceCommit* d = Device(device);
    std::lock_guard<std::mutex> lock(d->mutex);
    variant = d->variant;
    reason = d->why;
  }
  if (why != nullptr && why_size > 0) {
    std::snprintf(why, why_size, "%s", reason.c_str());
  }
  return variant;
}

const char* tapd_cuda_commit_name(int variant) { return VariantName(variant); }

// The installed ring's registration: 0 and the bytes pinned, whether mapped for the
// devices, and how long cudaHostRegister took; 1 if no ring is installed or registered.
int tapd_cuda_ring_registration(uint64_t* bytes, int* mapped, double* seconds) {
  void* ring = g_api != nullptr ? g_api->installed(tapd::kRingDaemon) : nullptr;
  if (ring == nullptr) return 1;
  std::lock_guard<std::mutex> lock(g_mutex);
  auto found = g_registered.find(ring);
  if (found == g_registered.end() || found->second == nullptr) return 1;  // (not yet)
  const Registration& r = *found->second;
  *bytes = r.registered;
  *mapped = r.device_base != 0;
  *seconds = r.seconds;
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
