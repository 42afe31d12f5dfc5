// The GPU bench's C++, one source built two ways (no nvcc, no kernels, either way):
//   - as is, a program: the commit variants without JAX (step 1 of bench/gpu-check);
//   - with -DTAPD_BENCH_BARE_COPY, a shared library: the per-tap benchmark's bare copy,
//     an XLA FFI handler (bench/gpu_bench.py compiles it, as tapd's CUDA handler is).

#ifdef TAPD_BENCH_BARE_COPY

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

#else  // the commit-variant program

// What a tap's commit costs a CUDA stream, without JAX, XLA or tapd: step 1 of
// bench/gpu-check. Each iteration is what a tapped step does to its stream: a 1 MiB
// cudaMemsetAsync (the step's work), a 64 B device-to-host copy of it into mapped pinned
// memory (the tap's copy), then one commit variant:
//   none          nothing (the bare copy: what a tap cannot do without)
//   host          cudaLaunchHostFunc on the stream (tapd's first design)
//   stream        cuStreamWriteValue32 of a commit word into the mapped memory (tapd's
//                 default where supported), through cudaGetDriverEntryPoint
//   event         cudaEventRecord on the stream, a host thread polling the events in order
//   side          an event recorded on the stream, a side stream waiting on it, a host
//                 function on the side stream (tapd's fallback)
// For each: GPU µs per iteration (events around the loop) and wall µs per iteration
// (until every commit was seen by the host), whether every commit was seen, in order,
// and after its copy's data (data before flag). One JSON line per variant on stdout.
//
// Build (no nvcc, no kernels): g++ -std=c++17 -O2 -I<cuda>/include gpu_baseline.cc
//   -L<cuda>/lib -l:libcudart.so.12 -lpthread   (bench/gpu-check does it)
// Usage: gpu_baseline [iterations] [variant ...]. Exit 3 if there is no CUDA device.

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using StreamWriteValue32 = CUresult (*)(cudaStream_t, CUdeviceptr, uint32_t, unsigned int);

constexpr size_t kWorkBytes = 1 << 20;
constexpr size_t kCopyBytes = 64;
constexpr int kEvents = 1024;  // event variant: events in flight at most

#define CHECK(call)                                                                  \
  do {                                                                               \
    cudaError_t err_ = (call);                                                       \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "gpu_baseline: %s: %s\n", #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

StreamWriteValue32 DriverWrite32() {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &function, 12000,
                                                     cudaEnableDefault, &found);
#else
  cudaError_t err =
      cudaGetDriverEntryPoint("cuStreamWriteValue32", &function, cudaEnableDefault, &found);
#endif
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<StreamWriteValue32>(function);
}

struct Shared {
  volatile uint32_t* flags;  // one commit word per iteration, in mapped pinned memory
  volatile uint8_t* slots;   // one 64 B copy per iteration, in mapped pinned memory
  std::atomic<int> next{0};  // host functions: the next iteration expected
  std::atomic<int> out_of_order{0};
  std::atomic<int> stale_data{0};
};

// The copy of iteration i holds the memset's value for it: the data arrived before its
// commit if it is there when the commit is seen.
uint8_t Value(int i) { return uint8_t(i * 7 + 1); }

bool DataThere(const Shared& s, int i) {
  for (size_t b = 0; b < kCopyBytes; ++b) {
    if (s.slots[size_t(i) * kCopyBytes + b] != Value(i)) return false;
  }
  return true;
}

void HostCommit(void* data) {  // a host function: must not call CUDA
  auto* s = static_cast<Shared*>(data);
  int i = s->next.fetch_add(1);
  if (!DataThere(*s, i)) s->stale_data.fetch_add(1);
  s->flags[i] = uint32_t(i + 1);
}

struct Result {
  std::string variant;
  int iterations = 0;
  double gpu_us = 0;
  double wall_us = 0;
  int seen = 0;
  int out_of_order = 0;
  int stale_data = 0;
  std::string note;
};

Result Run(const std::string& variant, int n, StreamWriteValue32 write32) {
  Result r;
  r.variant = variant;
  r.iterations = n;
  cudaStream_t stream, side;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  void* work;
  CHECK(cudaMalloc(&work, kWorkBytes));
  void* host;
  size_t flag_bytes = size_t(n) * sizeof(uint32_t);
  CHECK(cudaHostAlloc(&host, flag_bytes + size_t(n) * kCopyBytes,
                      cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, flag_bytes + size_t(n) * kCopyBytes);
  void* device_host;
  CHECK(cudaHostGetDevicePointer(&device_host, host, 0));
  Shared s;
  s.flags = static_cast<volatile uint32_t*>(host);
  s.slots = static_cast<volatile uint8_t*>(host) + flag_bytes;
  std::vector<cudaEvent_t> events(variant == "event" ? kEvents : 1);
  for (auto& e : events) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));

  // The host's view of the commits: wait for each in turn; a later one seen before an
  // earlier one is out of order; its copy's bytes must be there when it is seen.
  std::atomic<int> recorded{0};  // event variant: events recorded so far
  std::atomic<int> seen{0};      // commits the watcher has seen, in order
  std::atomic<bool> failed{false};
  std::thread watcher([&] {
    for (int i = 0; i < n && !failed.load(); ++i) {
      if (variant == "event") {
        while (recorded.load(std::memory_order_acquire) <= i && !failed.load()) {
          std::this_thread::yield();
        }
        if (cudaEventSynchronize(events[i % kEvents]) != cudaSuccess) break;
        s.flags[i] = uint32_t(i + 1);  // (the host marks what the event said)
      } else if (variant == "none") {
        break;  // nothing to see: timed by the stream alone
      }
      while (s.flags[i] == 0 && !failed.load()) {
        if (i + 1 < n && s.flags[i + 1] != 0 && s.flags[i] == 0) {
          s.out_of_order.fetch_add(1);
          break;
        }
      }
      if (!DataThere(s, i)) s.stale_data.fetch_add(1);
      seen.store(i + 1, std::memory_order_release);
    }
  });

  auto began = std::chrono::steady_clock::now();
  CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < n; ++i) {
    CHECK(cudaMemsetAsync(work, Value(i), kWorkBytes, stream));
    CHECK(cudaMemcpyAsync(const_cast<uint8_t*>(s.slots) + size_t(i) * kCopyBytes, work,
                          kCopyBytes, cudaMemcpyDeviceToHost, stream));
    if (variant == "host") {
      CHECK(cudaLaunchHostFunc(stream, HostCommit, &s));
    } else if (variant == "stream") {
      CUdeviceptr flag = reinterpret_cast<CUdeviceptr>(device_host) + uint64_t(i) * 4;
      if (write32(stream, flag, uint32_t(i + 1), 0) != 0) {
        failed = true;
        r.note = "cuStreamWriteValue32 failed";
        break;
      }
    } else if (variant == "event") {
      while (i - seen.load(std::memory_order_acquire) >= kEvents - 1) {
        std::this_thread::yield();  // (an event is reused once the watcher saw it)
      }
      CHECK(cudaEventRecord(events[i % kEvents], stream));
      recorded.store(i + 1, std::memory_order_release);
    } else if (variant == "side") {
      CHECK(cudaEventRecord(events[0], stream));
      CHECK(cudaStreamWaitEvent(side, events[0], 0));
      CHECK(cudaLaunchHostFunc(side, HostCommit, &s));
    }
  }
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaStreamSynchronize(side));
  watcher.join();
  auto ended = std::chrono::steady_clock::now();
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  r.gpu_us = double(ms) * 1000 / n;
  r.wall_us = std::chrono::duration<double, std::micro>(ended - began).count() / n;
  r.seen = seen.load();
  r.out_of_order += s.out_of_order.load();
  r.stale_data += s.stale_data.load();
  if (variant == "none") r.seen = n;  // (no commits to see)
  for (auto& e : events) cudaEventDestroy(e);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFreeHost(host);
  cudaFree(work);
  cudaStreamDestroy(stream);
  cudaStreamDestroy(side);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int n = argc > 1 ? std::atoi(argv[1]) : 20000;
  std::vector<std::string> variants;
  for (int i = 2; i < argc; ++i) variants.emplace_back(argv[i]);
  if (variants.empty()) variants = {"none", "host", "stream", "event", "side"};
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("{\"error\": \"no CUDA device: %s\"}\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "none");
    return 3;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  std::fprintf(stderr, "gpu_baseline: %s, driver %d, runtime %d, %d iterations\n", prop.name,
               driver, runtime, n);
  StreamWriteValue32 write32 = DriverWrite32();
  for (const std::string& variant : variants) {
    Result r;
    if (variant == "stream" && write32 == nullptr) {
      r.variant = variant;
      r.note = "no cuStreamWriteValue32 in this driver";
    } else {
      Run(variant, 200, write32);  // warm up
      r = Run(variant, n, write32);
    }
    std::printf("{\"variant\": \"%s\", \"iterations\": %d, \"gpu_us_per_iter\": %.3f, "
                "\"wall_us_per_iter\": %.3f, \"commits_seen\": %d, \"out_of_order\": %d, "
                "\"data_after_flag\": %d, \"note\": \"%s\"}\n",
                r.variant.c_str(), r.iterations, r.gpu_us, r.wall_us, r.seen, r.out_of_order,
                r.stale_data, r.note.c_str());
    std::fflush(stdout);
  }
  return 0;
}

#endif  // TAPD_BENCH_BARE_COPY
