// tapd's native hot path: an XLA FFI handler that copies a tap's operands into a
// shared-memory ring, and the C functions (loaded with ctypes) that create, attach to
// and drain that ring. No Python runs on the tap path.
//
// Ring file layout (docs/PROTOCOL.md, "Shared-memory ring"):
//   [ one page: RingControl ][ capacity bytes of records ]
// The record area is mapped twice, back to back, so a record that crosses the end of
// the ring is still contiguous in memory: any record up to `capacity` bytes fits.
//
// Writers (XLA threads, several at once) reserve space with a CAS on `head`, copy, and
// then commit in reservation order by advancing `committed` (a writer whose predecessor
// is still copying waits for it; that wait is one memcpy long). The reader (the daemon)
// consumes [tail, committed) and advances `tail` only once the taps were delivered, so a
// daemon that dies loses nothing: its successor starts again from `tail`.

#include <fcntl.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <unordered_map>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr uint64_t kMagic = 0x31474e4952504154ULL;  // "TAPRING1"
constexpr uint32_t kVersion = 2;  // 2: the reader_sleeping flag and the wake socket
// The control page: 4096 bytes, or one page where pages are larger (the record area
// must start on a page boundary to be mapped twice).
const size_t kControlBytes =
    sysconf(_SC_PAGESIZE) > 4096 ? size_t(sysconf(_SC_PAGESIZE)) : size_t{4096};
constexpr int64_t kNoStep = INT64_MIN;
constexpr uint32_t kPolicyBlock = 0;
constexpr uint32_t kPolicyDropNewest = 1;

struct RingControl {
  uint64_t magic;
  uint32_t version;
  uint32_t policy;
  uint64_t capacity;
  int64_t writer_pid;
  alignas(64) std::atomic<uint64_t> head;       // next byte to reserve
  alignas(64) std::atomic<uint64_t> committed;  // every byte below is readable
  alignas(64) std::atomic<uint64_t> tail;       // every byte below was delivered
  alignas(64) std::atomic<uint64_t> taps;       // committed tap records
  std::atomic<uint64_t> dropped;                // refused for lack of space
  std::atomic<uint64_t> blocked_ns;             // total time writers waited for space
  std::atomic<int64_t> reader_pid;              // the daemon draining it, 0 if none
  // Set by an idle daemon before it sleeps; a writer that commits and finds it set
  // clears it and sends a datagram to `wake.sock` beside the ring (see Wake).
  alignas(64) std::atomic<uint32_t> reader_sleeping;
};
static_assert(sizeof(RingControl) <= 4096, "control block must fit its page");

// One record; 8-byte aligned; followed by the leaves' bytes, each padded to 8.
struct RecordHeader {
  uint32_t length;  // whole record, header included, multiple of 8
  uint32_t nleaves;
  uint64_t site;    // tap site id (registered in the emitter's .sites file)
  uint64_t seq;     // per (consumer, device), counting drops too: gaps are visible
  int64_t step;     // kNoStep if none
  int64_t time_ns;  // CLOCK_REALTIME
  int32_t device;
  uint32_t reserved;
};

struct Ring {
  RingControl* control;
  uint8_t* data;  // capacity bytes, mapped twice
  uint64_t capacity;
  size_t mapped;  // bytes of address space reserved
  // This process's writers: the next seq per (consumer << 32 | device), and the lock
  // under which a writer takes its seq and its place in the ring (ReserveWithSeq).
  std::mutex seq_mutex;
  std::unordered_map<uint64_t, uint64_t> seq;
  // The daemon's wake socket, beside the ring (writers only), and a socket to send on.
  sockaddr_un wake_address{};
  socklen_t wake_length = 0;
  std::atomic<int> wake_fd{-1};
};

uint64_t Align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

int64_t NowNs(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

Ring* MapRing(int fd, uint64_t capacity) {
  size_t total = kControlBytes + 2 * capacity;
  void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  auto* bytes = static_cast<uint8_t*>(base);
  int prot = PROT_READ | PROT_WRITE;
  // MAP_POPULATE: fault the pages in now, not one by one on the tap path.
  int flags = MAP_SHARED | MAP_FIXED | MAP_POPULATE;
  if (mmap(bytes, kControlBytes + capacity, prot, flags, fd, 0) ==
          MAP_FAILED ||
      mmap(bytes + kControlBytes + capacity, capacity, prot, flags, fd,
           kControlBytes) == MAP_FAILED) {
    munmap(base, total);
    return nullptr;
  }
  return new Ring{reinterpret_cast<RingControl*>(bytes), bytes + kControlBytes, capacity,
                  total};
}

// The emitter process's ring, used by the FFI handler.
std::atomic<Ring*> g_ring{nullptr};

// Large leaves are copied with non-temporal (streaming) stores: the ring is read by
// another process, later, so pulling its cache lines into this core first (what plain
// stores do) only doubles the memory traffic. Measured on the benchmark machine: a
// 1 MiB copy into a rotating 256 MB /dev/shm buffer takes ~40 us this way, ~68 us with
// memcpy. Small leaves stay with memcpy: the daemon reads them soon, from the cache.
constexpr size_t kStreamingCopyBytes = 32 * 1024;

void CopyToRing(uint8_t* dst, const void* source, size_t size) {
  const uint8_t* src = static_cast<const uint8_t*>(source);
#if defined(__SSE2__)
  if (size >= kStreamingCopyBytes) {
    size_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    std::memcpy(dst, src, head);  // up to the first 64-byte boundary of the ring
    dst += head;
    src += head;
    size -= head;
    for (; size >= 64; size -= 64, dst += 64, src += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
      __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 48), d);
    }
    _mm_sfence();  // streaming stores are weakly ordered: finish them before the commit
  }
#endif
  if (size) std::memcpy(dst, src, size);  // all of a small leaf; the tail of a large one
}

// Reserve `length` bytes; returns the position or UINT64_MAX if dropped.
uint64_t Reserve(Ring* ring, uint64_t length) {
  RingControl* c = ring->control;
  uint64_t head = c->head.load(std::memory_order_relaxed);
  int64_t waiting_since = 0;
  bool warned = false;
  for (int spins = 0;; ++spins) {
    uint64_t tail = c->tail.load(std::memory_order_acquire);
    if (tail > head) {  // our `head` went stale while the reader moved on: reload it
      head = c->head.load(std::memory_order_relaxed);
      continue;
    }
    if (head + length - tail <= ring->capacity) {
      if (c->head.compare_exchange_weak(head, head + length, std::memory_order_acq_rel,
                                        std::memory_order_relaxed)) {
        if (waiting_since) {
          c->blocked_ns.fetch_add(NowNs(CLOCK_MONOTONIC) - waiting_since,
                                  std::memory_order_relaxed);
        }
        return head;
      }
      continue;  // lost the race: `head` was reloaded by the CAS
    }
    if (c->policy == kPolicyDropNewest) {
      c->dropped.fetch_add(1, std::memory_order_relaxed);
      return UINT64_MAX;
    }
    // Policy block: the device pauses until the daemon frees space, as host_callback's
    // outfeed did. Spin briefly, then sleep in short steps.
    if (!waiting_since) waiting_since = NowNs(CLOCK_MONOTONIC);
    if (spins < 64) {
      sched_yield();
    } else {
      timespec pause{0, 50000};
      nanosleep(&pause, nullptr);
    }
    if (!warned && NowNs(CLOCK_MONOTONIC) - waiting_since > 5000000000LL) {
      warned = true;
      std::fprintf(stderr,
                   "tapd: a tap has waited 5 s for ring space (policy block); is the tapd "
                   "daemon running and draining? (`tapd status`)\n");
    }
    head = c->head.load(std::memory_order_relaxed);
  }
}

// A sequence number for (consumer, device) and, unless the tap is dropped, its place in
// the ring, taken together under one lock: two threads tapping the same consumer on the
// same device then land in the ring in sequence order. (Apart, a thread could take seq
// 5, be preempted, and reserve after the thread that took seq 6.) A tap larger than the
// whole ring, or refused under drop_newest, still uses up its number: the gap shows.
// Returns the position, or UINT64_MAX if dropped.
uint64_t ReserveWithSeq(Ring* ring, uint64_t length, uint32_t consumer, int32_t device,
                        uint64_t* seq) {
  std::lock_guard<std::mutex> lock(ring->seq_mutex);
  *seq = ring->seq[(uint64_t{consumer} << 32) | uint32_t(device)]++;
  if (length > ring->capacity || length > UINT32_MAX) {
    ring->control->dropped.fetch_add(1, std::memory_order_relaxed);
    std::fprintf(stderr, "tapd: a %llu-byte tap is larger than the whole ring; dropped\n",
                 static_cast<unsigned long long>(length));
    return UINT64_MAX;
  }
  return Reserve(ring, length);
}

void Commit(Ring* ring, uint64_t position, uint64_t length) {
  RingControl* c = ring->control;
  // Commits happen in reservation order; wait for the writer before us to finish.
  // With more writer threads than cores the predecessor may be preempted: back off
  // from spinning to yielding to short sleeps so that it gets the core.
  for (int spins = 0; c->committed.load(std::memory_order_acquire) != position; ++spins) {
    if (spins < 64) continue;
    if (spins < 256) {
      sched_yield();
    } else {
      timespec pause{0, 2000};
      nanosleep(&pause, nullptr);
    }
  }
  c->taps.fetch_add(1, std::memory_order_relaxed);
  c->committed.store(position + length, std::memory_order_release);
}

// After a commit: if the daemon went to sleep (its rings had nothing to read), wake it
// with one datagram. It costs a fence per tap, and a syscall only on the first tap after
// the daemon went idle. No daemon, or a full socket buffer: nothing to do (it polls
// its rings now and then anyway).
void Wake(Ring* ring) {
  RingControl* c = ring->control;
  // Pairs with the fence in tapd_ring_sleep: either the daemon sees our commit before
  // it sleeps, or we see its flag here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (ring->wake_length == 0 || !c->reader_sleeping.load(std::memory_order_relaxed) ||
      !c->reader_sleeping.exchange(0, std::memory_order_acq_rel)) {
    return;
  }
  int fd = ring->wake_fd.load(std::memory_order_acquire);
  if (fd < 0) {
    int fresh = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fresh < 0) return;
    if (!ring->wake_fd.compare_exchange_strong(fd, fresh)) {
      close(fresh);  // another thread made one first: `fd` is now that one
    } else {
      fd = fresh;
    }
  }
  char byte = 1;
  sendto(fd, &byte, 1, MSG_DONTWAIT | MSG_NOSIGNAL,
         reinterpret_cast<const sockaddr*>(&ring->wake_address), ring->wake_length);
}

ffi::Error TapImpl(int32_t device, ffi::RemainingArgs args, int64_t site, int64_t consumer,
                   int64_t has_step) {
  Ring* ring = g_ring.load(std::memory_order_acquire);
  if (ring == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "tapd: native tap ran before the emitter attached its ring");
  }
  size_t nleaves = args.size() - (has_step ? 1 : 0);
  uint64_t length = sizeof(RecordHeader);
  for (size_t i = 0; i < nleaves; ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    length += Align8(buffer->size_bytes());
  }
  uint64_t seq = 0;
  uint64_t position = ReserveWithSeq(ring, length, uint32_t(consumer), device, &seq);
  if (position == UINT64_MAX) return ffi::Error::Success();  // counted as dropped
  uint8_t* out = ring->data + (position % ring->capacity);
  RecordHeader header{};
  header.length = uint32_t(length);
  header.nleaves = uint32_t(nleaves);
  header.site = uint64_t(site);
  header.seq = seq;
  header.step = kNoStep;
  if (has_step) {
    auto step = args.get<ffi::AnyBuffer>(nleaves);
    if (step.has_error()) return step.error();
    header.step = step->element_type() == ffi::DataType::S64
                      ? *static_cast<int64_t*>(step->untyped_data())
                      : *static_cast<int32_t*>(step->untyped_data());
  }
  header.time_ns = NowNs(CLOCK_REALTIME);
  header.device = device;
  std::memcpy(out, &header, sizeof(header));
  uint64_t offset = sizeof(header);
  for (size_t i = 0; i < nleaves; ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    size_t size = buffer->size_bytes();
    if (size) CopyToRing(out + offset, buffer->untyped_data(), size);
    offset += Align8(size);
  }
  Commit(ring, position, length);
  Wake(ring);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TapdTap, TapImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("site")
                                  .Attr<int64_t>("consumer")
                                  .Attr<int64_t>("has_step"));

// ---- C API for ctypes (tapd/native/ring.py) ------------------------------------------

extern "C" {

// Create a ring file (mode 0600, must not exist); capacity: a multiple of the page size.
void* tapd_ring_create(const char* path, uint64_t capacity, uint32_t policy) {
  if (capacity == 0 || capacity % uint64_t(sysconf(_SC_PAGESIZE)) != 0) {
    errno = EINVAL;
    return nullptr;
  }
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return nullptr;
  if (ftruncate(fd, off_t(kControlBytes + capacity)) != 0) {
    int saved = errno;
    close(fd);
    unlink(path);
    errno = saved;
    return nullptr;
  }
  Ring* ring = MapRing(fd, capacity);
  int saved = errno;
  close(fd);
  if (ring == nullptr) {
    unlink(path);
    errno = saved;
    return nullptr;
  }
  RingControl* c = new (ring->control) RingControl();
  c->version = kVersion;
  c->policy = policy == kPolicyDropNewest ? kPolicyDropNewest : kPolicyBlock;
  c->capacity = capacity;
  c->writer_pid = getpid();
  std::atomic_thread_fence(std::memory_order_release);
  c->magic = kMagic;
  // The daemon's wake socket lives beside the ring: <ring directory>/wake.sock.
  const char* slash = std::strrchr(path, '/');
  size_t dir = slash == nullptr ? 0 : size_t(slash - path) + 1;
  static const char kWake[] = "wake.sock";
  if (dir + sizeof(kWake) <= sizeof(ring->wake_address.sun_path)) {
    ring->wake_address.sun_family = AF_UNIX;
    std::memcpy(ring->wake_address.sun_path, path, dir);
    std::memcpy(ring->wake_address.sun_path + dir, kWake, sizeof(kWake));
    ring->wake_length = socklen_t(offsetof(sockaddr_un, sun_path) + dir + sizeof(kWake));
  }
  return ring;
}

// Map an existing ring (the daemon's side). Returns null with errno set, EPROTO if the
// file is not a ring of this version.
void* tapd_ring_open(const char* path) {
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  RingControl probe;
  struct stat info;
  if (fstat(fd, &info) != 0 || info.st_size < off_t(kControlBytes) ||
      pread(fd, &probe, sizeof(uint64_t) * 3, 0) != sizeof(uint64_t) * 3 ||
      probe.magic != kMagic || probe.version != kVersion ||
      info.st_size != off_t(kControlBytes + probe.capacity)) {
    close(fd);
    errno = EPROTO;
    return nullptr;
  }
  Ring* ring = MapRing(fd, probe.capacity);
  int saved = errno;
  close(fd);
  errno = saved;
  return ring;
}

void tapd_ring_close(void* handle) {
  auto* ring = static_cast<Ring*>(handle);
  if (ring == nullptr) return;
  Ring* expected = ring;
  g_ring.compare_exchange_strong(expected, nullptr);
  int fd = ring->wake_fd.exchange(-1);
  if (fd >= 0) close(fd);
  munmap(ring->control, ring->mapped);
  delete ring;
}

// Make `handle` the ring this process's FFI taps write to.
void tapd_ring_install(void* handle) { g_ring.store(static_cast<Ring*>(handle)); }

// Reader: the committed bytes not yet consumed start at *data; returns their length.
// The region is contiguous (double mapping) and holds whole records.
uint64_t tapd_ring_readable(void* handle, uint64_t from, const uint8_t** data) {
  auto* ring = static_cast<Ring*>(handle);
  uint64_t committed = ring->control->committed.load(std::memory_order_acquire);
  *data = ring->data + (from % ring->capacity);
  if (from >= committed) return 0;
  uint64_t available = committed - from;
  return available > ring->capacity ? ring->capacity : available;
}

// Reader, about to sleep: ask writers for a wake-up datagram. Returns 1, and asks
// nothing, if records from `from` on are already readable (then there is work now).
int tapd_ring_sleep(void* handle, uint64_t from) {
  RingControl* c = static_cast<Ring*>(handle)->control;
  c->reader_sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the one in Wake
  if (c->committed.load(std::memory_order_relaxed) > from) {
    c->reader_sleeping.store(0, std::memory_order_relaxed);
    return 1;
  }
  return 0;
}

// Reader: every record below `position` has been delivered; writers may reuse it.
void tapd_ring_release(void* handle, uint64_t position) {
  RingControl* c = static_cast<Ring*>(handle)->control;
  uint64_t committed = c->committed.load(std::memory_order_acquire);
  if (position > committed) position = committed;  // never hand out unwritten space
  if (position > c->tail.load(std::memory_order_relaxed)) {
    c->tail.store(position, std::memory_order_release);
  }
}

// Counters and positions, for the daemon and for `barrier_wait`.
void tapd_ring_counters(void* handle, uint64_t* out /* [8] */) {
  RingControl* c = static_cast<Ring*>(handle)->control;
  out[0] = c->head.load(std::memory_order_acquire);
  out[1] = c->committed.load(std::memory_order_acquire);
  out[2] = c->tail.load(std::memory_order_acquire);
  out[3] = c->taps.load(std::memory_order_relaxed);
  out[4] = c->dropped.load(std::memory_order_relaxed);
  out[5] = c->blocked_ns.load(std::memory_order_relaxed);
  out[6] = uint64_t(c->writer_pid);
  out[7] = c->capacity;
}

void tapd_ring_set_reader(void* handle, int64_t pid) {
  static_cast<Ring*>(handle)->control->reader_pid.store(pid, std::memory_order_release);
}

// Write one record from the calling thread (tests and benchmarks of the ring itself).
// Returns 0, or 1 if dropped.
int tapd_ring_write(void* handle, uint64_t site, uint32_t consumer, int32_t device,
                    int64_t step, const uint8_t* payload, uint64_t size) {
  auto* ring = static_cast<Ring*>(handle);
  uint64_t length = sizeof(RecordHeader) + Align8(size);
  uint64_t seq = 0;
  uint64_t position = ReserveWithSeq(ring, length, consumer, device, &seq);
  if (position == UINT64_MAX) return 1;
  uint8_t* out = ring->data + (position % ring->capacity);
  RecordHeader header{uint32_t(length), 1, site, seq, step, NowNs(CLOCK_REALTIME), device, 0};
  std::memcpy(out, &header, sizeof(header));
  if (size) std::memcpy(out + sizeof(header), payload, size);
  Commit(ring, position, length);
  Wake(ring);
  return 0;
}

uint64_t tapd_ring_record_header_bytes() { return sizeof(RecordHeader); }

}  // extern "C"
