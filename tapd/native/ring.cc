// tapd's shared-memory ring (layout and protocol in ring.h and docs/PROTOCOL.md) and
// the C functions, loaded with ctypes (tapd/native/ring.py), that create, attach to,
// write and drain it. Builds with a C++17 compiler alone.

#include "ring.h"

#include <fcntl.h>
#include <signal.h>
#include <sched.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <vector>
#include <random>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tapd {
namespace {

// The header area (control page and site table): kHeaderBytes, or one page where pages
// are larger (the record area must start on a page boundary to be mapped twice).
const size_t kHeaderArea = sysconf(_SC_PAGESIZE) > long(kHeaderBytes)
                                 ? size_t(sysconf(_SC_PAGESIZE))
                                 : size_t{kHeaderBytes};

int64_t NowNs(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

uint64_t LoadTag(const RecordHeader* h) {
  return __atomic_load_n(&h->commit, __ATOMIC_ACQUIRE);
}

void StoreTag(RecordHeader* h, uint64_t tag) {
  __atomic_store_n(&h->commit, tag, __ATOMIC_RELEASE);
}

// Each ring mapped gets the next (Ring::generation).
std::atomic<uint64_t> g_ring_generations{0};

Ring* MapRing(int fd, uint64_t capacity) {
  size_t total = kHeaderArea + 2 * capacity;
  void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  auto* bytes = static_cast<uint8_t*>(base);
  int prot = PROT_READ | PROT_WRITE;
  // MAP_POPULATE: fault the pages in now, not one by one on the tap path.
  int flags = MAP_SHARED | MAP_FIXED | MAP_POPULATE;
  if (mmap(bytes, kHeaderArea + capacity, prot, flags, fd, 0) == MAP_FAILED ||
      mmap(bytes + kHeaderArea + capacity, capacity, prot, flags, fd, kHeaderArea) ==
          MAP_FAILED) {
    munmap(base, total);
    return nullptr;
  }
  auto* ring = new Ring();
  ring->generation = g_ring_generations.fetch_add(1, std::memory_order_relaxed) + 1;
  ring->control = reinterpret_cast<RingControl*>(bytes);
  ring->sites = reinterpret_cast<SiteSlot*>(bytes + kSiteTableOffset);
  ring->data = bytes + kHeaderArea;
  ring->capacity = capacity;
  ring->mapped = total;
  return ring;
}

// The emitter process's rings (kRingDaemon, kRingLocal), used by the FFI handlers and
// the portable backend.
std::atomic<Ring*> g_rings[2] = {nullptr, nullptr};

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

void ExplainWait(Ring* ring, uint64_t length, int64_t waited_ns);

// Sends the reader its datagram if it asked for one (tapd_ring_sleep, tapd_ring_gather).
void Wake(Ring* ring, bool writer_waits = false);

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
      Wake(ring, /*writer_waits=*/true);  // a reader letting taps gather: no longer
      return UINT64_MAX;
    }
    // Policy block: the device pauses until the daemon frees space, as host_callback's
    // outfeed did. Spin briefly, then sleep in short steps.
    if (!waiting_since) {
      waiting_since = NowNs(CLOCK_MONOTONIC);
      Wake(ring, /*writer_waits=*/true);
    }
    if (spins < 64) {
      sched_yield();
    } else {
      timespec pause{0, 50000};
      nanosleep(&pause, nullptr);
    }
    if (!warned && NowNs(CLOCK_MONOTONIC) - waiting_since > ring->wait_warning_ns) {
      warned = true;
      ExplainWait(ring, length, NowNs(CLOCK_MONOTONIC) - waiting_since);
    }
    head = c->head.load(std::memory_order_relaxed);
  }
}

// Whether the process that created the ring is gone: nobody holds its writer lock any
// more. (A pid could be reused, or be another pid namespace's; the lock cannot.) Never
// true for the writer's own handle, nor for a handle that cannot tell.
bool WriterGone(Ring* ring) {
  if (ring->writer || ring->fd < 0) return false;
  if (flock(ring->fd, LOCK_SH | LOCK_NB) != 0) return false;
  flock(ring->fd, LOCK_UN);
  return true;
}

bool Sane(uint64_t length, uint64_t position, uint64_t head) {
  return length >= sizeof(RecordHeader) && length % 8 == 0 && length <= head - position;
}

// The writer is gone: every record in [position, head) that is neither committed nor
// abandoned will never be committed. Mark each abandoned and count it. A record whose
// header was never written (the writer died between reserving it and writing its
// length) is found by its successor's tag: a filler record, abandoned, takes its place.
void AbandonDeadRecords(Ring* ring, uint64_t position, uint64_t head) {
  RingControl* c = ring->control;
  while (position < head) {
    RecordHeader* h = HeaderAt(ring, position);
    uint64_t tag = LoadTag(h);
    uint64_t length = __atomic_load_n(&h->length, __ATOMIC_RELAXED);
    bool sane = Sane(length, position, head);
    if (sane && (tag == Tag(c, position, kTagCommitted) ||
                 tag == Tag(c, position, kTagAbandoned))) {
      position += length;
      continue;
    }
    if (sane && tag == Tag(c, position, kTagReserved)) {
      if (__atomic_compare_exchange_n(&h->commit, &tag, Tag(c, position, kTagAbandoned),
                                      false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        c->abandoned.fetch_add(1, std::memory_order_relaxed);
      }
      position += length;
      continue;
    }
    // No header: look for the next record's, 8 bytes at a time.
    uint64_t next = position + sizeof(RecordHeader);
    for (; next + sizeof(RecordHeader) <= head; next += 8) {
      const RecordHeader* candidate = HeaderAt(ring, next);
      uint64_t t = LoadTag(candidate);
      uint64_t state = t & 7;
      if (state >= kTagReserved && state <= kTagAbandoned &&
          t == Tag(c, next, state) &&
          Sane(__atomic_load_n(&candidate->length, __ATOMIC_RELAXED), next, head)) {
        break;
      }
    }
    if (next + sizeof(RecordHeader) > head) next = head;
    // Fillers of at most 1 GiB each (a record length is 32 bits), none shorter than a
    // header.
    bool first = true;
    while (position < next) {
      uint64_t gap = next - position;
      uint64_t piece = gap <= (uint64_t{1} << 30) ? gap : (uint64_t{1} << 30);
      if (gap - piece != 0 && gap - piece < sizeof(RecordHeader)) piece -= 64;
      RecordHeader* filler = HeaderAt(ring, position);
      uint64_t stale = LoadTag(filler);
      __atomic_store_n(&filler->length, uint32_t(piece), __ATOMIC_RELAXED);
      filler->nleaves = 0;
      filler->flags = 0;
      if (__atomic_compare_exchange_n(&filler->commit, &stale,
                                      Tag(c, position, kTagAbandoned), false,
                                      __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE) &&
          first) {
        c->abandoned.fetch_add(1, std::memory_order_relaxed);
      }
      first = false;
      position += piece;
    }
  }
}

// Move `committed` over every consecutive committed record (and the abandoned ones
// between them; never onto a trailing abandoned one, so that a reader that has read
// to `committed` has always just read a record). A reader (`check_writer`) stuck on a
// record that is only reserved abandons it, and every other unfinished one, if the
// writer is gone. Returns `committed`.
uint64_t Advance(Ring* ring, bool check_writer) {
  RingControl* c = ring->control;
  uint64_t position = c->committed.load(std::memory_order_acquire);
  bool checked = false;
  for (;;) {
    uint64_t head = c->head.load(std::memory_order_acquire);
    uint64_t p = position;
    uint64_t end = position;
    while (p < head) {
      const RecordHeader* h = HeaderAt(ring, p);
      uint64_t tag = LoadTag(h);
      uint64_t length = __atomic_load_n(&h->length, __ATOMIC_RELAXED);
      if (Sane(length, p, head)) {
        if (tag == Tag(c, p, kTagCommitted)) {
          p += length;
          end = p;
          continue;
        }
        if (tag == Tag(c, p, kTagAbandoned)) {
          p += length;
          continue;
        }
      }
      if (!check_writer || checked) break;
      checked = true;  // one lock test per call
      if (!WriterGone(ring)) break;
      AbandonDeadRecords(ring, p, head);  // then look at `p` again
    }
    if (end == position) return position;
    // (seq_cst: pairs with the fence after a commit tag's store; see CommitRecord.)
    if (c->committed.compare_exchange_strong(position, end, std::memory_order_seq_cst)) {
      position = end;
    }  // else `position` is the newer `committed`: go on from there
  }
}

// Whether half the ring or more waits for the reader.
bool HalfFull(RingControl* c, uint64_t capacity) {
  uint64_t head = c->head.load(std::memory_order_relaxed);
  uint64_t tail = c->tail.load(std::memory_order_relaxed);
  return head > tail && (head - tail) * 2 >= capacity;
}

// After a commit: if the daemon went to sleep (its rings had nothing to read), wake it
// with one datagram. It costs a fence per tap, and a syscall only on the first tap after
// the daemon went idle. No daemon, or a full socket buffer: nothing to do (it polls
// its rings now and then anyway).
void Wake(Ring* ring, bool writer_waits) {
  RingControl* c = ring->control;
  // Pairs with the fence in tapd_ring_sleep: either the daemon sees our commit before
  // it sleeps, or we see its flag here.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  uint32_t sleeping = c->reader_sleeping.load(std::memory_order_relaxed);
  if (ring->wake_length == 0 || sleeping == 0) return;
  // A reader letting taps gather (tapd_ring_gather) is woken only once half the ring
  // waits for it, or a writer finds no room.
  if (sleeping == kReaderGathering && !writer_waits && !HalfFull(c, ring->capacity)) return;
  if (!c->reader_sleeping.exchange(0, std::memory_order_acq_rel)) return;
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

// After a record's tag was stored: make it (and any it completes) readable, then wake a
// sleeping reader. The fence orders the tag store before `committed` is read: of two
// writers committing neighbours at once, at least one sees the other's tag, so the last
// commit always moves `committed` over both (and a reader that sleeps has either seen
// the tag or left its flag for Wake to see).
void Published(Ring* ring) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  Advance(ring, false);
  Wake(ring);
}

const char* HeldReason(uint32_t code) {
  switch (code) {
    case kHeldNotRead:
      return "committed, not yet read by the daemon (is it busy, or stopped?)";
    case kHeldUnacked:
      return "read by the daemon, held for a subscriber that has not acknowledged it";
    case kHeldGrace:
      return "held by the daemon during its startup grace (no subscriber wants it yet)";
    case kHeldQueueFull:
      return "waiting in the daemon for room in a subscriber's queue (policy block)";
    case kHeldSiteUnknown:
      return "waiting in the daemon for its site's entry in the .sites file";
    case kHeldDetached:
      return "the daemon let go of this ring (it took this process for gone): nothing "
             "drains it";
    case kHeldNothing:
      return "the daemon says it holds nothing: it should release it at its next poll";
    default:
      return "held by the daemon, which does not say why (an older tapd?)";
  }
}

// A tap has waited `waited_ns` for `length` bytes: say where the ring stands and why
// its oldest unreleased record (at `tail`) is held, so that whoever reads it knows
// whom to look at (tapd/native/ring.h: kHeld*).
void ExplainWait(Ring* ring, uint64_t length, int64_t waited_ns) {
  RingControl* c = ring->control;
  uint64_t committed = Advance(ring, false);
  uint64_t head = c->head.load(std::memory_order_acquire);
  uint64_t tail = c->tail.load(std::memory_order_acquire);
  int64_t reader = c->reader_pid.load(std::memory_order_acquire);
  char record[160];
  char why[200];
  const RecordHeader* h = HeaderAt(ring, tail);
  uint64_t tag = LoadTag(h);
  uint64_t state = tag & 7;
  uint64_t size = __atomic_load_n(&h->length, __ATOMIC_RELAXED);
  bool known = tail < head && state >= kTagReserved && state <= kTagAbandoned &&
               tag == Tag(c, tail, state) && Sane(size, tail, head);
  if (known) {
    std::snprintf(record, sizeof(record), "%llu bytes, site %llu, seq %llu, %s",
                  static_cast<unsigned long long>(size),
                  static_cast<unsigned long long>(h->site),
                  static_cast<unsigned long long>(h->seq),
                  state == kTagCommitted ? "committed"
                  : state == kTagReserved ? "reserved, not committed"
                                          : "abandoned");
  } else {
    std::snprintf(record, sizeof(record), "no record header yet");
  }
  if (tail >= committed) {
    std::snprintf(why, sizeof(why),
                  "its writer in this process has not committed it yet (a CUDA stream "
                  "that has not reached the tap's commit, or a copy still running)");
  } else if (reader <= 0) {
    std::snprintf(why, sizeof(why),
                  "no daemon attached to this ring (is `tapd start` running? `tapd "
                  "status`)");
  } else if (kill(pid_t(reader), 0) != 0 && errno == ESRCH) {
    std::snprintf(why, sizeof(why), "its daemon (pid %lld) is gone",
                  static_cast<long long>(reader));
  } else {
    std::snprintf(why, sizeof(why), "daemon pid %lld: %s", static_cast<long long>(reader),
                  HeldReason(c->held_reason.load(std::memory_order_acquire)));
  }
  std::fprintf(stderr,
               "tapd: a tap of %llu bytes has waited %.1f s for ring space (policy "
               "block). Ring: %llu bytes, head %llu, committed %llu, tail %llu (%llu "
               "bytes unreleased). The oldest unreleased record, at %llu (%s), is held: "
               "%s\n",
               static_cast<unsigned long long>(length), double(waited_ns) / 1e9,
               static_cast<unsigned long long>(ring->capacity),
               static_cast<unsigned long long>(head),
               static_cast<unsigned long long>(committed),
               static_cast<unsigned long long>(tail),
               static_cast<unsigned long long>(head - tail),
               static_cast<unsigned long long>(tail), record, why);
}

// Whether the first record at or after `committed` (stepping over abandoned ones) is
// reserved with its commit to be written by a device (kFlagDeviceCommit), which wakes
// no reader. (One reserved by host code wakes the reader when it commits.)
bool DeviceCommitPending(Ring* ring, uint64_t committed) {
  RingControl* c = ring->control;
  uint64_t head = c->head.load(std::memory_order_acquire);
  for (uint64_t p = committed; p < head;) {
    const RecordHeader* h = HeaderAt(ring, p);
    uint64_t tag = LoadTag(h);
    uint64_t length = __atomic_load_n(&h->length, __ATOMIC_RELAXED);
    if (!Sane(length, p, head)) return false;
    if (tag == Tag(c, p, kTagAbandoned)) {
      p += length;
      continue;
    }
    return tag == Tag(c, p, kTagReserved) &&
           (__atomic_load_n(&h->flags, __ATOMIC_RELAXED) & kFlagDeviceCommit) != 0;
  }
  return false;
}

}  // namespace

Ring* InstalledRing(int32_t which) {
  if (which != kRingDaemon && which != kRingLocal) return nullptr;
  return g_rings[which].load(std::memory_order_acquire);
}

// ---- Sites by their entry (the handlers' `entry` attribute) ---------------------------

namespace {

// Asked for an entry new to a ring: returns 0 with the ids (having put them, and
// installed the ring if there was none), or nonzero with the reason in `error`.
using SiteResolver = int (*)(int32_t which, const char* entry, uint64_t length,
                             uint64_t* site, uint32_t* consumer, char* error,
                             uint64_t error_size);
std::atomic<SiteResolver> g_site_resolver{nullptr};
// One resolution at a time (the resolver runs Python; a second thread with the same new
// entry then finds it put).
std::mutex g_resolve_mutex;

// A tap finds its site here without a lock, in the common case: the last entries this
// thread looked up, by the attribute's address, its length and its bytes (an address
// freed with its executable may hold another entry later).
struct CachedEntry {
  uint64_t generation = 0;  // the ring's; 0: empty
  int32_t which = -1;
  const char* address = nullptr;
  std::string bytes;
  uint64_t site = 0;
  uint32_t consumer = 0;
};
constexpr size_t kCachedEntries = 16;
thread_local CachedEntry t_entries[kCachedEntries];

bool FindEntry(Ring* ring, const std::string& key, uint64_t* site, uint32_t* consumer) {
  std::lock_guard<std::mutex> lock(ring->entries_mutex);
  auto found = ring->entries.find(key);
  if (found == ring->entries.end()) return false;
  *site = found->second.first;
  *consumer = found->second.second;
  return true;
}

}  // namespace

Ring* SiteOfEntry(int32_t which, const char* entry, uint64_t length, uint64_t* site,
                  uint32_t* consumer, std::string* error) {
  Ring* ring = InstalledRing(which);
  CachedEntry& cached =
      t_entries[(reinterpret_cast<uintptr_t>(entry) >> 3) % kCachedEntries];
  if (ring != nullptr && cached.generation == ring->generation && cached.which == which &&
      cached.address == entry && cached.bytes.size() == length &&
      memcmp(cached.bytes.data(), entry, length) == 0) {
    *site = cached.site;
    *consumer = cached.consumer;
    return ring;
  }
  std::string key(entry, length);
  if (ring == nullptr || !FindEntry(ring, key, site, consumer)) {
    std::lock_guard<std::mutex> lock(g_resolve_mutex);
    ring = InstalledRing(which);
    if (ring == nullptr || !FindEntry(ring, key, site, consumer)) {
      SiteResolver resolve = g_site_resolver.load(std::memory_order_acquire);
      if (resolve == nullptr) {
        *error = "tapd: this process has not loaded tapd's emitter (import tapd), which "
                 "registers the sites of a computation compiled elsewhere";
        return nullptr;
      }
      char reason[1024] = {0};
      if (resolve(which, entry, length, site, consumer, reason, sizeof(reason)) != 0) {
        *error = reason;
        return nullptr;
      }
      ring = InstalledRing(which);
      if (ring == nullptr) {
        *error = "tapd: the site resolver installed no ring";
        return nullptr;
      }
    }
  }
  cached.generation = ring->generation;
  cached.which = which;
  cached.address = entry;
  cached.bytes = std::move(key);
  cached.site = *site;
  cached.consumer = *consumer;
  return ring;
}

// A sequence number for (consumer, device) and, unless the tap is dropped, its place in
// the ring, taken together under one lock: two threads tapping the same consumer on the
// same device then land in the ring in sequence order. (Apart, a thread could take seq
// 5, be preempted, and reserve after the thread that took seq 6.) A tap larger than the
// whole ring, or refused under drop_newest, still uses up its number: the gap shows.
bool TakeTap(Ring* ring, uint64_t site, uint64_t seq, uint64_t every) {
  if (TapWanted(ring, site, seq, every)) return true;
  CountSkipped(ring, site, 1);
  return false;
}

// TakeTap's rule alone: nothing counted.
bool TapWanted(Ring* ring, uint64_t site, uint64_t seq, uint64_t every) {
  uint64_t k = (every & ~kEveryAlwaysBit) ? (every & ~kEveryAlwaysBit) : 1;
  bool has_slot = site < kSiteSlots;  // a site without one: never dormant, its own K only
  bool always = (every & kEveryAlwaysBit) != 0 || !has_slot;
  uint32_t wanted = always ? kEveryAll : ring->sites[site].every.load(std::memory_order_relaxed);
  if (wanted == kEveryDormant) return false;
  uint64_t n = wanted == kEveryAll ? 1 : wanted;
  if (k == 1 && n == 1) return true;  // (every tap: no division)
  // seq % (k * n) == 0, without overflowing k * n.
  return seq % k == 0 && (seq / k) % n == 0;
}

void CountSkipped(Ring* ring, uint64_t site, uint64_t taps) {
  if (site < kSiteSlots) ring->sites[site].skipped.fetch_add(taps, std::memory_order_relaxed);
  ring->control->skipped.fetch_add(taps, std::memory_order_relaxed);
}

uint8_t* BeginRecord(Ring* ring, uint64_t length, const RecordFields& fields,
                     uint32_t nleaves, uint32_t flags, uint64_t* position, bool* skipped) {
  RingControl* c = ring->control;
  uint64_t seq;
  uint64_t at;
  RecordHeader* h;
  if (skipped != nullptr) *skipped = false;
  {
    std::lock_guard<std::mutex> lock(ring->seq_mutex);
    seq = ring->seq[(uint64_t{fields.consumer} << 32) | uint32_t(fields.device)]++;
    // A dormant or sampled-out tap: its seq is used up, nothing is reserved or copied.
    if (!TakeTap(ring, fields.site, seq, fields.every)) {
      if (skipped != nullptr) *skipped = true;
      return nullptr;
    }
    if (length > ring->capacity || length > UINT32_MAX) {
      c->dropped.fetch_add(1, std::memory_order_relaxed);
      std::fprintf(stderr, "tapd: a %llu-byte tap is larger than the whole ring; dropped\n",
                   static_cast<unsigned long long>(length));
      return nullptr;
    }
    at = Reserve(ring, length);
    if (at == UINT64_MAX) return nullptr;  // counted as dropped
    // At once, so that a reader can step over the record should this process die
    // before committing it.
    h = HeaderAt(ring, at);
    __atomic_store_n(&h->length, uint32_t(length), __ATOMIC_RELAXED);
    StoreTag(h, Tag(c, at, kTagReserved));
  }
  h->nleaves = nleaves;
  h->site = fields.site;
  h->seq = seq;
  h->step = fields.step;
  h->time_ns = NowNs(CLOCK_REALTIME);
  h->device = fields.device;
  h->flags = flags;
  *position = at;
  return reinterpret_cast<uint8_t*>(h);
}

void CommitRecord(Ring* ring, uint64_t position, int64_t time_ns) {
  RingControl* c = ring->control;
  RecordHeader* h = HeaderAt(ring, position);
  if (h->flags & kFlagStep32) {  // an int32 step was copied into the low 4 bytes
    h->step = int32_t(uint32_t(uint64_t(h->step)));
  }
  h->flags = 0;
  if (time_ns) h->time_ns = time_ns;
  c->taps.fetch_add(1, std::memory_order_relaxed);
  StoreTag(h, Tag(c, position, kTagCommitted));
  Published(ring);
}

void AbandonRecord(Ring* ring, uint64_t position) {
  RingControl* c = ring->control;
  RecordHeader* h = HeaderAt(ring, position);
  h->flags = 0;
  c->abandoned.fetch_add(1, std::memory_order_relaxed);
  StoreTag(h, Tag(c, position, kTagAbandoned));
  Published(ring);  // records after it may be readable now
}

int WriteLeaves(Ring* ring, const RecordFields& fields, uint32_t nleaves,
                const void* const* data, const uint64_t* sizes) {
  uint64_t length = sizeof(RecordHeader);
  for (uint32_t i = 0; i < nleaves; ++i) length += Align8(sizes[i]);
  uint64_t position;
  bool skipped;
  uint8_t* out = BeginRecord(ring, length, fields, nleaves, 0, &position, &skipped);
  if (out == nullptr) return skipped ? 3 : 1;
  uint64_t offset = sizeof(RecordHeader);
  for (uint32_t i = 0; i < nleaves; ++i) {
    if (sizes[i]) CopyToRing(out + offset, data[i], sizes[i]);
    offset += Align8(sizes[i]);
  }
  CommitRecord(ring, position, 0);
  return 0;
}

// ---- Runs of records written together: the gathered path's bulk write ----------------
//
// A gathered computation's log (tapd/emitter/gathered/host.py) holds thousands of small
// records back to back. Written one by one (WriteLeaves), each takes the seq lock, looks
// its seq up, reserves with a CAS, reads the clock, and commits with two fences and a
// walk of `committed`: ~100 ns a 64-byte record, more than its copy. A run is written
// instead as the same records in the same places: their seqs taken and their space
// reserved under one hold of the lock (one CAS), their headers marked reserved at once
// (as BeginRecord does, for a reader that outlives this process), then filled, copied,
// and committed with one publication. What a reader sees, and every count, is what the
// records written one at a time at that moment would have left: a tap skipped (dormant,
// sampled) uses up its seq and is counted; one that does not fit under drop_newest is
// dropped and counted, its seq used up; under block the writer waits for room, having
// committed the records it reserved before (the reader could not free room past them).
namespace {

// The records of a run reserved and committed together, at most: a reader starts on
// them while the next are copied.
constexpr size_t kRunRecords = 1024;
constexpr uint64_t kRunBytes = 256 * 1024;

// A gathered computation's per-site tables (tapd_ring_write_gathered's arguments).
struct GatheredSites {
  const uint8_t* packed;
  int32_t device;
  void* const* rings;
  const uint64_t* site_ids;
  const uint32_t* consumers;
  const uint64_t* everys;
  const uint32_t* first_leaf;
  const uint32_t* nleaves;
  const uint64_t* leaf_offsets;
  const uint64_t* leaf_bytes;
  const int32_t* step_bytes;
  const uint64_t* step_offsets;

  // A record of site `i`, header included.
  uint64_t Length(uint32_t i) const {
    uint64_t length = sizeof(RecordHeader);
    for (uint32_t j = 0; j < nleaves[i]; ++j) length += Align8(leaf_bytes[first_leaf[i] + j]);
    return length;
  }

  int64_t Step(uint32_t i, uint64_t row) const {
    uint64_t stride = step_bytes[i] > 0 ? uint64_t(step_bytes[i]) : 0;
    const uint8_t* at = packed + step_offsets[i] + row * stride;
    if (step_bytes[i] == 4) {
      int32_t step32;
      std::memcpy(&step32, at, sizeof(step32));
      return step32;
    }
    int64_t step = kNoStep;
    if (step_bytes[i] == 8) std::memcpy(&step, at, sizeof(step));
    return step;
  }

  // Record `row` of site `i` (its seq `seq`), at `h`: everything but its length and tag.
  void Fill(RecordHeader* h, uint32_t i, uint64_t row, uint64_t seq, int64_t time_ns) const {
    h->nleaves = nleaves[i];
    h->site = site_ids[i];
    h->seq = seq;
    h->step = Step(i, row);
    h->time_ns = time_ns;
    h->device = device;
    h->flags = 0;
    uint8_t* out = reinterpret_cast<uint8_t*>(h) + sizeof(RecordHeader);
    for (uint32_t j = 0; j < nleaves[i]; ++j) {
      uint64_t k = uint64_t{first_leaf[i]} + j;
      if (leaf_bytes[k]) {
        CopyToRing(out, packed + leaf_offsets[k] + row * leaf_bytes[k], leaf_bytes[k]);
      }
      out += Align8(leaf_bytes[k]);
    }
  }
};

// One chunk of a run being written: its records (indices into the log) and their seqs,
// back to back in the ring from `first`.
struct Chunk {
  struct Member {
    size_t record;
    uint64_t seq;
  };
  std::vector<Member> members = std::vector<Member>(kRunRecords);
  size_t size = 0;
  uint64_t first = 0;  // the first record's ring position
  uint64_t bytes = 0;  // theirs, headers included
};

// Whether the tap of site `i` with this `seq` is copied (TakeTap's rule, TapWanted),
// its common case first: K 1, and a slot that says all or 1 in 1.
inline bool Wanted(Ring* ring, const GatheredSites& s, uint32_t i, uint64_t seq) {
  uint64_t site = s.site_ids[i];
  if (s.everys[i] == 1 && site < kSiteSlots &&
      ring->sites[site].every.load(std::memory_order_relaxed) <= 1) {
    return true;
  }
  return TapWanted(ring, site, seq, s.everys[i]);
}

// Records [begin, end) of a gathered log into `ring`: record r is row rows[r] of site
// sites_of[r] (each of those sites' ring is `ring`), none of them with taps skipped on
// the device between it and its site's record before. `seq_of[i]`: site i's seq counter
// in the ring, found once under the lock (never erased: its address holds).
void WriteRun(Ring* ring, const GatheredSites& s, const uint32_t* sites_of,
              const uint64_t* rows, const uint64_t* lengths, size_t begin, size_t end,
              std::vector<uint64_t*>& seq_of) {
  RingControl* c = ring->control;
  Chunk chunk;
  size_t r = begin;
  while (r < end) {
    chunk.size = 0;
    chunk.bytes = 0;
    {
      std::lock_guard<std::mutex> lock(ring->seq_mutex);
      uint64_t head = c->head.load(std::memory_order_acquire);
      uint64_t tail = c->tail.load(std::memory_order_acquire);
      bool reserved = false;  // (its one record waited for room: Reserve reserved it)
      for (; r < end && chunk.size < kRunRecords && chunk.bytes < kRunBytes; ++r) {
        uint32_t i = sites_of[r];
        uint64_t*& seq = seq_of[i];
        if (seq == nullptr) {
          seq = &ring->seq[(uint64_t{s.consumers[i]} << 32) | uint32_t(s.device)];
        }
        if (!Wanted(ring, s, i, *seq)) {
          CountSkipped(ring, s.site_ids[i], 1);
          ++*seq;
          continue;
        }
        uint64_t length = lengths[i];
        if (length > ring->capacity || length > UINT32_MAX) {  // (as BeginRecord)
          c->dropped.fetch_add(1, std::memory_order_relaxed);
          std::fprintf(stderr, "tapd: a %llu-byte tap is larger than the whole ring; dropped\n",
                       static_cast<unsigned long long>(length));
          ++*seq;
          continue;
        }
        if (head + chunk.bytes + length - tail > ring->capacity) {
          tail = c->tail.load(std::memory_order_acquire);
        }
        if (head + chunk.bytes + length - tail > ring->capacity) {
          if (chunk.size > 0) break;  // those first: the reader can free no room past them
          if (c->policy == kPolicyDropNewest) {
            c->dropped.fetch_add(1, std::memory_order_relaxed);
            Wake(ring, /*writer_waits=*/true);
            ++*seq;
            continue;
          }
          // block: this record waits for room alone, as a tap written alone does.
          chunk.first = Reserve(ring, length);
          chunk.members[chunk.size++] = {r++, (*seq)++};
          chunk.bytes = length;
          reserved = true;
          break;
        }
        chunk.members[chunk.size++] = {r, (*seq)++};
        chunk.bytes += length;
      }
      if (chunk.size == 0) continue;
      if (!reserved) {
        chunk.first = head;
        if (!c->head.compare_exchange_strong(chunk.first, head + chunk.bytes,
                                             std::memory_order_acq_rel,
                                             std::memory_order_relaxed)) {
          // `head` moved outside the lock (tapd's writers never move it so; a test's
          // bare reservation does): the chunk as a whole goes where it now can.
          chunk.first = Reserve(ring, chunk.bytes);
          if (chunk.first == UINT64_MAX) {  // dropped: Reserve counted one of them
            c->dropped.fetch_add(chunk.size - 1, std::memory_order_relaxed);
            continue;
          }
        }
      }
      // At once, so that a reader can step over the records should this process die
      // before committing them (as BeginRecord).
      uint8_t* at = reinterpret_cast<uint8_t*>(HeaderAt(ring, chunk.first));
      uint64_t position = chunk.first;
      for (size_t m = 0; m < chunk.size; ++m) {
        auto* h = reinterpret_cast<RecordHeader*>(at + (position - chunk.first));
        uint64_t length = lengths[sites_of[chunk.members[m].record]];
        __atomic_store_n(&h->length, uint32_t(length), __ATOMIC_RELAXED);
        StoreTag(h, Tag(c, position, kTagReserved));
        position += length;
      }
    }
    // (Not HeaderAt a record: its division cost more than a small record's copy. The
    // chunk is contiguous from `at`: the ring is mapped twice.)
    uint8_t* at = reinterpret_cast<uint8_t*>(HeaderAt(ring, chunk.first));
    int64_t now = NowNs(CLOCK_REALTIME);
    for (uint64_t m = 0, offset = 0; m < chunk.size; ++m) {
      size_t record = chunk.members[m].record;
      s.Fill(reinterpret_cast<RecordHeader*>(at + offset), sites_of[record], rows[record],
             chunk.members[m].seq, now);
      offset += lengths[sites_of[record]];
    }
    for (uint64_t m = 0, offset = 0; m < chunk.size; ++m) {
      StoreTag(reinterpret_cast<RecordHeader*>(at + offset),
               Tag(c, chunk.first + offset, kTagCommitted));
      offset += lengths[sites_of[chunk.members[m].record]];
    }
    c->taps.fetch_add(chunk.size, std::memory_order_relaxed);
    // `committed` over the chunk at once where it stops at its start (Advance would read
    // every record's header again); then on as every commit moves it (Published).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    uint64_t start = chunk.first;
    c->committed.compare_exchange_strong(start, chunk.first + chunk.bytes,
                                         std::memory_order_seq_cst);
    Published(ring);
  }
}

}  // namespace

namespace {

// ---- The table a handler library built apart (ffi_cuda.cc) writes through ----------

void* ApiInstalled(int32_t which) { return InstalledRing(which); }

uint8_t* ApiBegin(void* ring, uint64_t length, uint64_t site, uint32_t consumer,
                  int32_t device, uint32_t nleaves, int64_t step, uint32_t flags,
                  uint64_t every, uint64_t* position) {
  return BeginRecord(static_cast<Ring*>(ring), length,
                     RecordFields{site, consumer, device, step, every}, nleaves, flags,
                     position);
}

void ApiCommit(void* ring, uint64_t position, int64_t time_ns) {
  CommitRecord(static_cast<Ring*>(ring), position, time_ns);
}

void ApiAbandon(void* ring, uint64_t position) {
  AbandonRecord(static_cast<Ring*>(ring), position);
}

void ApiHold(void* ring) {
  static_cast<Ring*>(ring)->async_pending.fetch_add(1, std::memory_order_acq_rel);
}

void ApiUnhold(void* ring) {
  static_cast<Ring*>(ring)->async_pending.fetch_sub(1, std::memory_order_acq_rel);
}

uint8_t* ApiRecords(void* handle, uint64_t* capacity) {
  auto* ring = static_cast<Ring*>(handle);
  *capacity = ring->capacity;
  return ring->data;
}

void ApiSetCloseHook(void* handle, void (*hook)(void*)) {
  auto* ring = static_cast<Ring*>(handle);
  std::lock_guard<std::mutex> lock(ring->hook_mutex);
  ring->close_hook = hook;
}

std::atomic<void (*)(void*)> g_install_hook{nullptr};

void ApiSetInstallHook(void (*hook)(void*)) {
  g_install_hook.store(hook, std::memory_order_release);
  if (hook != nullptr) {
    for (int32_t which : {kRingDaemon, kRingLocal}) {
      if (Ring* ring = InstalledRing(which)) hook(ring);
    }
  }
}

uint64_t ApiCommitTag(void* handle, uint64_t position, uint64_t* offset) {
  auto* ring = static_cast<Ring*>(handle);
  *offset = (position + offsetof(RecordHeader, commit)) % ring->capacity;
  return Tag(ring->control, position, kTagCommitted);
}

// (`length` from the caller: once the device has written the tag, the record may be
// read, released and its space reused before this runs.)
void ApiDeviceCommitEnqueued(void* handle, uint64_t position, uint64_t length) {
  auto* ring = static_cast<Ring*>(handle);
  uint64_t end = position + length;
  uint64_t seen = ring->device_end.load(std::memory_order_relaxed);
  while (seen < end && !ring->device_end.compare_exchange_weak(seen, end)) {
  }
  ring->control->taps.fetch_add(1, std::memory_order_relaxed);
  Wake(ring);  // a sleeping reader then polls until the tag lands (tapd_ring_sleep)
}

void* ApiSiteOfEntry(int32_t which, const char* entry, uint64_t length, uint64_t* site,
                     uint32_t* consumer, char* error, uint64_t error_size) {
  std::string reason;
  Ring* ring = SiteOfEntry(which, entry, length, site, consumer, &reason);
  if (ring == nullptr && error_size > 0) {
    snprintf(error, error_size, "%s", reason.c_str());
  }
  return ring;
}

const RingApi kApi = {
    kApiVersion,       sizeof(RingApi), ApiInstalled, ApiBegin,
    ApiCommit,         ApiAbandon,      ApiHold,      ApiUnhold,
    ApiRecords,        ApiSetCloseHook, ApiSetInstallHook, ApiCommitTag,
    ApiDeviceCommitEnqueued, ApiSiteOfEntry,
};

}  // namespace
}  // namespace tapd

using tapd::Ring;
using tapd::RingControl;

// ---- C API for ctypes (tapd/native/ring.py, tapd/native/library.py) -------------------

extern "C" {

const tapd::RingApi* tapd_ring_internal_api(uint32_t version) {
  return version == tapd::kApiVersion ? &tapd::kApi : nullptr;
}

// The emitter puts the ids it gave a site it lowered, under the site's entry (the
// handler's `entry` attribute), so that its taps find them without asking.
void tapd_ring_put_entry(void* handle, const char* entry, uint64_t length, uint64_t site,
                         uint32_t consumer) {
  auto* ring = static_cast<Ring*>(handle);
  std::lock_guard<std::mutex> lock(ring->entries_mutex);
  ring->entries[std::string(entry, length)] = {site, consumer};
}

// What a tap asks of an entry new to its ring (tapd/emitter/entries.py); nullptr: none.
void tapd_set_site_resolver(tapd::SiteResolver resolver) {
  tapd::g_site_resolver.store(resolver, std::memory_order_release);
}

// Create a ring file (mode 0600, must not exist); capacity: a multiple of the page size.
// The calling process is its writer: it holds the file's writer lock until close.
void* tapd_ring_create(const char* path, uint64_t capacity, uint32_t policy) {
  if (capacity == 0 || capacity % uint64_t(sysconf(_SC_PAGESIZE)) != 0) {
    errno = EINVAL;
    return nullptr;
  }
  int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return nullptr;
  // (Blocking: a reader's lock test holds the lock only for a moment.)
  if (flock(fd, LOCK_EX) != 0 ||
      ftruncate(fd, off_t(tapd::kHeaderArea + capacity)) != 0) {
    int saved = errno;
    close(fd);
    unlink(path);
    errno = saved;
    return nullptr;
  }
  Ring* ring = tapd::MapRing(fd, capacity);
  if (ring == nullptr) {
    int saved = errno;
    close(fd);
    unlink(path);
    errno = saved;
    return nullptr;
  }
  ring->fd = fd;
  ring->writer = true;
  if (const char* seconds = std::getenv("TAPD_RING_WAIT_WARNING_S")) {
    char* end = nullptr;
    double value = std::strtod(seconds, &end);
    if (end != seconds && value >= 0 && value < 1e6) ring->wait_warning_ns = int64_t(value * 1e9);
  }
  RingControl* c = new (ring->control) RingControl();
  c->version = tapd::kVersion;
  c->policy = policy == tapd::kPolicyDropNewest ? tapd::kPolicyDropNewest : tapd::kPolicyBlock;
  c->capacity = capacity;
  c->writer_pid = getpid();
  std::random_device entropy;
  c->nonce = (uint64_t{entropy()} << 32) ^ entropy() ^ uint64_t(tapd::NowNs(CLOCK_MONOTONIC));
  std::atomic_thread_fence(std::memory_order_release);
  c->magic = tapd::kMagic;
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
  uint64_t probe[3];  // magic; version and policy; capacity
  uint32_t version;
  struct stat info;
  if (fstat(fd, &info) != 0 || info.st_size < off_t(tapd::kHeaderArea) ||
      pread(fd, probe, sizeof(probe), 0) != sizeof(probe) || probe[0] != tapd::kMagic ||
      (std::memcpy(&version, &probe[1], sizeof(version)), version != tapd::kVersion) ||
      info.st_size != off_t(tapd::kHeaderArea + probe[2]) ||
      probe[2] == 0 || probe[2] % uint64_t(sysconf(_SC_PAGESIZE)) != 0) {  // capacity
    close(fd);
    errno = EPROTO;
    return nullptr;
  }
  Ring* ring = tapd::MapRing(fd, probe[2]);
  if (ring == nullptr) {
    int saved = errno;
    close(fd);
    errno = saved;
    return nullptr;
  }
  ring->fd = fd;  // kept: its lock test tells whether the writer still lives
  return ring;
}

void tapd_ring_close(void* handle) {
  auto* ring = static_cast<Ring*>(handle);
  if (ring == nullptr) return;
  for (auto& installed : tapd::g_rings) {
    Ring* expected = ring;
    installed.compare_exchange_strong(expected, nullptr);
  }
  // Device copies still on their way land in this memory, and their commits read it:
  // wait for them (a stream runs them in order), or leave it mapped.
  // (Commits a stream writes itself run no host code: wait until `committed` is past
  // the last of them.)
  for (int waited_ms = 0;
       ring->async_pending.load(std::memory_order_acquire) > 0 ||
       tapd::Advance(ring, false) < ring->device_end.load(std::memory_order_acquire);
       ++waited_ms) {
    if (waited_ms == 10000) {
      std::fprintf(stderr,
                   "tapd: closing a ring with device copies or commits still pending after "
                   "10 s (%lld host commits; committed %llu, the last device commit ends at "
                   "%llu); leaving it mapped\n",
                   static_cast<long long>(ring->async_pending.load()),
                   static_cast<unsigned long long>(ring->control->committed.load()),
                   static_cast<unsigned long long>(ring->device_end.load()));
      return;
    }
    timespec pause{0, 1000000};
    nanosleep(&pause, nullptr);
  }
  void (*hook)(void*) = nullptr;
  {
    std::lock_guard<std::mutex> lock(ring->hook_mutex);
    hook = ring->close_hook;
    ring->close_hook = nullptr;
  }
  if (hook != nullptr) hook(ring);
  int fd = ring->wake_fd.exchange(-1);
  if (fd >= 0) close(fd);
  if (ring->fd >= 0) close(ring->fd);  // the writer's lock goes with it
  munmap(ring->control, ring->mapped);
  delete ring;
}

// Make `handle` the ring this process's taps write to (and tell the CUDA library, if
// it is attached: it registers the ring with CUDA now).
void tapd_ring_install_at(void* handle, int32_t which) {
  if (which != tapd::kRingDaemon && which != tapd::kRingLocal) return;
  tapd::g_rings[which].store(static_cast<Ring*>(handle));
  void (*hook)(void*) = tapd::g_install_hook.load(std::memory_order_acquire);
  if (hook != nullptr && handle != nullptr) hook(handle);
}

void tapd_ring_install(void* handle) { tapd_ring_install_at(handle, tapd::kRingDaemon); }

// Reader: the committed bytes not yet consumed start at *data; returns their length.
// The region is contiguous (double mapping); it holds whole records, some of which may
// be abandoned (their commit tag says so: skip them), and ends with a committed one.
uint64_t tapd_ring_readable(void* handle, uint64_t from, const uint8_t** data) {
  auto* ring = static_cast<Ring*>(handle);
  uint64_t committed = tapd::Advance(ring, !ring->writer);
  *data = ring->data + (from % ring->capacity);
  if (from >= committed) return 0;
  uint64_t available = committed - from;
  return available > ring->capacity ? ring->capacity : available;
}

// Reader, about to sleep: ask writers for a wake-up datagram. Returns 1, and asks
// nothing, if records from `from` on are already readable (then there is work now), or
// if the next record's commit is to be written by a CUDA stream, which sends no
// datagram: the reader must keep polling (docs/PROTOCOL.md).
int tapd_ring_sleep(void* handle, uint64_t from) {
  auto* ring = static_cast<Ring*>(handle);
  RingControl* c = ring->control;
  c->reader_sleeping.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the one in Wake
  uint64_t committed = tapd::Advance(ring, !ring->writer);
  if (committed > from || tapd::DeviceCommitPending(ring, committed)) {
    c->reader_sleeping.store(0, std::memory_order_relaxed);
    return 1;
  }
  return 0;
}

// The reader lets taps gather for a while (tapd/emitter/local_path.py): a writer wakes
// it (the datagram of tapd_ring_sleep) only once half the ring waits for it. 0 if half
// of it does already (then nothing is asked). `on` 0: the reader is back; nothing is
// asked any more.
int tapd_ring_gather(void* handle, int on) {
  auto* ring = static_cast<Ring*>(handle);
  RingControl* c = ring->control;
  if (!on) {
    c->reader_sleeping.store(0, std::memory_order_relaxed);
    return 1;
  }
  c->reader_sleeping.store(tapd::kReaderGathering, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);  // pairs with the one in Wake
  if (tapd::HalfFull(c, ring->capacity)) {
    c->reader_sleeping.store(0, std::memory_order_relaxed);
    return 0;
  }
  return 1;
}

// The daemon: why it holds the oldest record it has not released (tapd::kHeld*).
void tapd_ring_set_held(void* handle, uint32_t reason) {
  static_cast<Ring*>(handle)->control->held_reason.store(reason, std::memory_order_release);
}

// The writer, for a barrier: `committed` once every record reserved before this call
// is committed or abandoned. Commits on their way from a CUDA side stream, or written by
// a device, may land after the computation's token is ready: a barrier must cover them.
// After `timeout_ms`, says which record holds it back and returns `committed` as it is.
uint64_t tapd_ring_settled(void* handle, uint32_t timeout_ms) {
  auto* ring = static_cast<Ring*>(handle);
  RingControl* c = ring->control;
  uint64_t head = c->head.load(std::memory_order_acquire);
  int64_t deadline = tapd::NowNs(CLOCK_MONOTONIC) + int64_t{timeout_ms} * 1000000;
  for (int spins = 0;; ++spins) {
    uint64_t committed = tapd::Advance(ring, false);
    // (Advance stops before trailing abandoned records: they settle too.)
    uint64_t p = committed;
    while (p < head) {
      const tapd::RecordHeader* h = tapd::HeaderAt(ring, p);
      uint64_t length = __atomic_load_n(&h->length, __ATOMIC_RELAXED);
      if (tapd::LoadTag(h) != tapd::Tag(c, p, tapd::kTagAbandoned) ||
          !tapd::Sane(length, p, head)) {
        break;
      }
      p += length;
    }
    if (p >= head) return committed;
    if (tapd::NowNs(CLOCK_MONOTONIC) > deadline) {
      const tapd::RecordHeader* h = tapd::HeaderAt(ring, p);
      std::fprintf(stderr,
                   "tapd: a barrier waited %u ms for the record at ring position %llu (site "
                   "%llu, seq %llu) to be committed; it still is not (a CUDA stream that "
                   "has not reached the tap?): the barrier covers the %llu bytes before it\n",
                   timeout_ms, static_cast<unsigned long long>(p),
                   static_cast<unsigned long long>(h->site),
                   static_cast<unsigned long long>(h->seq),
                   static_cast<unsigned long long>(committed));
      return committed;
    }
    if (spins < 64) {
      sched_yield();
    } else {
      timespec pause{0, 50000};
      nanosleep(&pause, nullptr);
    }
  }
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
void tapd_ring_counters(void* handle, uint64_t* out /* [10] */) {
  auto* ring = static_cast<Ring*>(handle);
  RingControl* c = ring->control;
  uint64_t committed = tapd::Advance(ring, !ring->writer);
  out[0] = c->head.load(std::memory_order_acquire);
  out[1] = committed;
  out[2] = c->tail.load(std::memory_order_acquire);
  out[3] = c->taps.load(std::memory_order_relaxed);
  out[4] = c->dropped.load(std::memory_order_relaxed);
  out[5] = c->blocked_ns.load(std::memory_order_relaxed);
  out[6] = uint64_t(c->writer_pid);
  out[7] = c->capacity;
  out[8] = c->abandoned.load(std::memory_order_relaxed);
  out[9] = c->skipped.load(std::memory_order_relaxed);
}

// ---- The site table (dormant and sampled taps; ring.h, SiteSlot) ----------------------

// The daemon: every how many of a site's taps its takers want (kEveryAll, kEveryDormant,
// or N). A site without a slot is ignored: it is always sent.
// Returns the slot's `relied_on` as it is after the store: 1 where the emitter must
// acknowledge a wake before it holds (ring.h, SiteSlot).
uint32_t tapd_ring_set_site_every(void* handle, uint64_t site, uint32_t every) {
  if (site >= tapd::kSiteSlots) return 0;
  auto& slot = static_cast<Ring*>(handle)->sites[site];
  slot.every.store(every, std::memory_order_seq_cst);
  return slot.relied_on.load(std::memory_order_seq_cst);
}

// The emitter: it is about to rely on the site's dormancy (ring.h, SiteSlot). Returns
// `every` as it is after the mark: the emitter relies on it only if it is dormant.
uint32_t tapd_ring_rely_on_site(void* handle, uint64_t site) {
  if (site >= tapd::kSiteSlots) return tapd::kEveryAll;
  auto& slot = static_cast<Ring*>(handle)->sites[site];
  slot.relied_on.store(1, std::memory_order_seq_cst);
  return slot.every.load(std::memory_order_seq_cst);
}

// The emitter: it relies on the site no more (a wake acknowledged).
void tapd_ring_release_site(void* handle, uint64_t site) {
  if (site >= tapd::kSiteSlots) return;
  static_cast<Ring*>(handle)->sites[site].relied_on.store(0, std::memory_order_seq_cst);
}

uint32_t tapd_ring_site_relied_on(void* handle, uint64_t site) {
  if (site >= tapd::kSiteSlots) return 0;
  return static_cast<Ring*>(handle)->sites[site].relied_on.load(std::memory_order_seq_cst);
}

uint32_t tapd_ring_site_every(void* handle, uint64_t site) {
  if (site >= tapd::kSiteSlots) return tapd::kEveryAll;
  return static_cast<Ring*>(handle)->sites[site].every.load(std::memory_order_acquire);
}

// Each slot's `skipped`, into out[kSiteSlots]; returns kSiteSlots.
uint32_t tapd_ring_skipped_by_site(void* handle, uint64_t* out) {
  auto* ring = static_cast<Ring*>(handle);
  for (uint32_t i = 0; i < tapd::kSiteSlots; ++i) {
    out[i] = ring->sites[i].skipped.load(std::memory_order_relaxed);
  }
  return tapd::kSiteSlots;
}

// The portable backend, before it copies anything: 1 if this tap is skipped (its seq
// taken and the skip counted, exactly as the write would), 0 if it is to be written (then
// nothing is taken: tapd_ring_write_leaves takes the seq and decides again, so a tap of
// the same consumer and device on another thread in between costs a wasted copy, never
// a wrong count). `handle` NULL: the installed ring; 0 if there is none.
int tapd_ring_skip(void* handle, uint64_t site, uint32_t consumer, int32_t device,
                   uint64_t every) {
  Ring* ring = handle != nullptr ? static_cast<Ring*>(handle) : tapd::InstalledRing();
  if (ring == nullptr) return 0;
  // Every tap of the site is taken (K = 1, and a slot of 0 or 1, an always site, or a
  // site without a slot): no need for the lock.
  bool always = (every & tapd::kEveryAlwaysBit) != 0 || site >= tapd::kSiteSlots;
  if ((every & ~tapd::kEveryAlwaysBit) <= 1 &&
      (always || ring->sites[site].every.load(std::memory_order_relaxed) <= 1)) {
    return 0;
  }
  uint64_t key = (uint64_t{consumer} << 32) | uint32_t(device);
  std::lock_guard<std::mutex> lock(ring->seq_mutex);
  uint64_t& seq = ring->seq[key];
  if (tapd::TakeTap(ring, site, seq, every)) return 0;
  ++seq;
  return 1;
}

// A gathered computation's `count` taps of `site` that the device did not keep, their
// site dormant when the computation was dispatched (tapd/emitter/taps_as_outputs.py):
// their seqs used up and the skips counted, as `count` dormant taps written one by one
// would have. `handle` NULL: the installed ring; nothing if there is none.
void tapd_ring_skip_many(void* handle, uint64_t site, uint32_t consumer, int32_t device,
                         uint64_t count) {
  Ring* ring = handle != nullptr ? static_cast<Ring*>(handle) : tapd::InstalledRing();
  if (ring == nullptr || count == 0) return;
  uint64_t key = (uint64_t{consumer} << 32) | uint32_t(device);
  {
    std::lock_guard<std::mutex> lock(ring->seq_mutex);
    ring->seq[key] += count;
  }
  if (site < tapd::kSiteSlots) ring->sites[site].skipped.fetch_add(count, std::memory_order_relaxed);
  ring->control->skipped.fetch_add(count, std::memory_order_relaxed);
}

// For readers that check commit tags themselves (ring.py skips abandoned records).
uint64_t tapd_ring_nonce(void* handle) { return static_cast<Ring*>(handle)->control->nonce; }

void tapd_ring_set_reader(void* handle, int64_t pid) {
  static_cast<Ring*>(handle)->control->reader_pid.store(pid, std::memory_order_release);
}

// The portable backend's whole tap in one call: one record of `nleaves` leaves, written
// exactly as the FFI handler writes it. `handle` NULL: the installed ring. `step`
// INT64_MIN: none. `every`: the site's own sampling (1: every tap). Returns 0 written,
// 1 dropped (counted), 2 no ring installed, 3 skipped (dormant or sampled out; counted).
int tapd_ring_write_leaves(void* handle, uint64_t site, uint32_t consumer, int32_t device,
                           int64_t step, uint64_t every, uint32_t nleaves,
                           const void* const* data, const uint64_t* sizes) {
  Ring* ring = handle != nullptr ? static_cast<Ring*>(handle) : tapd::InstalledRing();
  if (ring == nullptr) return 2;
  return tapd::WriteLeaves(ring, tapd::RecordFields{site, consumer, device, step, every},
                           nleaves, data, sizes);
}

// The seq the next tap of (consumer, device) takes in this process: where a gathered
// computation's sampling starts (tapd/emitter/gathered/sampling.py). `handle` NULL: the
// installed ring; 0 if there is none.
uint64_t tapd_ring_next_seq(void* handle, uint32_t consumer, int32_t device) {
  Ring* ring = handle != nullptr ? static_cast<Ring*>(handle) : tapd::InstalledRing();
  if (ring == nullptr) return 0;
  uint64_t key = (uint64_t{consumer} << 32) | uint32_t(device);
  std::lock_guard<std::mutex> lock(ring->seq_mutex);
  auto found = ring->seq.find(key);
  return found == ring->seq.end() ? 0 : found->second;
}

// A gathered computation's packed buffers (tapd/emitter/gathered/host.py, `Flush`)
// written as its taps' records, in the log's order, each into its site's ring. `packed`
// holds the log's length (int32) at `count_offset`, the log (an int32 site index a
// record) at `log_offset`, each record's place among its site's taps since the last
// flush (int32, kept or not) at `order_offset`, and each site's taps not kept (dormant
// or sampled out on the device; int32 a site) at `skipped_offset`. The taps not kept
// before a record use up their seqs and are counted as skipped just before it, the rest
// after the last record: each record takes the seq its tap would have taken alone.
// Site i's j-th leaf of record row r is at leaf_offsets[k] + r * leaf_bytes[k],
// k = first_leaf[i] + j, and its step (step_bytes[i] 4 or 8, signed; 0: none) at
// step_offsets[i] + r * step_bytes[i]. A site whose ring is NULL is left to the caller
// (the sender's path). Returns the records in the log, or -1 if the log names a site out
// of range, holds more than `capacity` records, or places a record before its site's
// last one or past its taps.
int64_t tapd_ring_write_gathered(const uint8_t* packed, int32_t device, uint32_t nsites,
                                 void* const* rings, const uint64_t* site_ids,
                                 const uint32_t* consumers, const uint64_t* everys,
                                 const uint32_t* first_leaf, const uint32_t* nleaves,
                                 const uint64_t* leaf_offsets, const uint64_t* leaf_bytes,
                                 const int32_t* step_bytes, const uint64_t* step_offsets,
                                 uint64_t count_offset, uint64_t log_offset,
                                 uint64_t order_offset, uint64_t skipped_offset,
                                 uint64_t capacity) {
  int32_t count;
  std::memcpy(&count, packed + count_offset, sizeof(count));
  if (count < 0 || uint64_t(count) > capacity) return -1;
  std::vector<uint64_t> taps(nsites, 0);  // each site's taps, kept or not
  for (uint32_t i = 0; i < nsites; ++i) {
    int32_t skipped;
    std::memcpy(&skipped, packed + skipped_offset + 4 * uint64_t{i}, sizeof(skipped));
    if (skipped < 0) return -1;
    taps[i] = uint64_t(skipped);
  }
  for (int32_t r = 0; r < count; ++r) {
    int32_t i;
    std::memcpy(&i, packed + log_offset + 4 * uint64_t(r), sizeof(i));
    if (i < 0 || uint32_t(i) >= nsites) return -1;
    ++taps[i];
  }
  std::vector<uint64_t> rows(nsites, 0);
  std::vector<uint64_t> done(nsites, 0);  // each site's taps accounted for so far
  std::vector<const void*> data;
  std::vector<uint64_t> sizes;
  auto skip = [&](uint32_t i, uint64_t upto) {
    if (upto > done[i] && rings[i] != nullptr) {
      tapd_ring_skip_many(rings[i], site_ids[i], consumers[i], device, upto - done[i]);
    }
    done[i] = upto;
  };
  for (int32_t r = 0; r < count; ++r) {
    int32_t i;
    int32_t place;
    std::memcpy(&i, packed + log_offset + 4 * uint64_t(r), sizeof(i));
    std::memcpy(&place, packed + order_offset + 4 * uint64_t(r), sizeof(place));
    if (place < 0 || uint64_t(place) < done[i] || uint64_t(place) >= taps[i]) return -1;
    skip(uint32_t(i), uint64_t(place));
    done[i] = uint64_t(place) + 1;
    uint64_t row = rows[i]++;
    if (rings[i] == nullptr) continue;
    data.resize(nleaves[i]);
    sizes.resize(nleaves[i]);
    for (uint32_t j = 0; j < nleaves[i]; ++j) {
      uint64_t k = uint64_t{first_leaf[i]} + j;
      data[j] = packed + leaf_offsets[k] + row * leaf_bytes[k];
      sizes[j] = leaf_bytes[k];
    }
    int64_t step = tapd::kNoStep;
    uint64_t step_stride = step_bytes[i] > 0 ? uint64_t(step_bytes[i]) : 0;
    const uint8_t* at = packed + step_offsets[i] + row * step_stride;
    if (step_bytes[i] == 4) {
      int32_t step32;
      std::memcpy(&step32, at, sizeof(step32));
      step = step32;
    } else if (step_bytes[i] == 8) {
      std::memcpy(&step, at, sizeof(step));
    }
    tapd::WriteLeaves(static_cast<Ring*>(rings[i]),
                      tapd::RecordFields{site_ids[i], consumers[i], device, step, everys[i]},
                      nleaves[i], data.data(), sizes.data());
  }
  for (uint32_t i = 0; i < nsites; ++i) skip(i, taps[i]);
  return count;
}

// tapd_ring_write_gathered's records, written in runs (WriteRun): the same records, seqs
// and counts, in the same order, with one reservation and one commit for up to
// kRunRecords records back to back. A run is the log's records from one with taps
// skipped on the device before it (those are counted first, as there) up to the next
// such, or a record of another ring. The whole log is checked before anything is
// written (tapd_ring_write_gathered writes the records before a bad one). Same
// arguments and result.
int64_t tapd_ring_write_gathered_runs(const uint8_t* packed, int32_t device, uint32_t nsites,
                                      void* const* rings, const uint64_t* site_ids,
                                      const uint32_t* consumers, const uint64_t* everys,
                                      const uint32_t* first_leaf, const uint32_t* nleaves,
                                      const uint64_t* leaf_offsets, const uint64_t* leaf_bytes,
                                      const int32_t* step_bytes, const uint64_t* step_offsets,
                                      uint64_t count_offset, uint64_t log_offset,
                                      uint64_t order_offset, uint64_t skipped_offset,
                                      uint64_t capacity) {
  int32_t count;
  std::memcpy(&count, packed + count_offset, sizeof(count));
  if (count < 0 || uint64_t(count) > capacity) return -1;
  std::vector<uint64_t> taps(nsites, 0);  // each site's taps, kept or not
  for (uint32_t i = 0; i < nsites; ++i) {
    int32_t skipped;
    std::memcpy(&skipped, packed + skipped_offset + 4 * uint64_t{i}, sizeof(skipped));
    if (skipped < 0) return -1;
    taps[i] = uint64_t(skipped);
  }
  std::vector<uint32_t> sites_of(static_cast<size_t>(count));
  std::vector<uint64_t> places(static_cast<size_t>(count));
  std::vector<uint64_t> rows(static_cast<size_t>(count));
  for (int32_t r = 0; r < count; ++r) {
    int32_t i;
    std::memcpy(&i, packed + log_offset + 4 * uint64_t(r), sizeof(i));
    if (i < 0 || uint32_t(i) >= nsites) return -1;
    sites_of[r] = uint32_t(i);
    ++taps[i];
  }
  std::vector<uint64_t> done(nsites, 0);  // each site's taps accounted for so far
  std::vector<uint64_t> next_row(nsites, 0);
  for (int32_t r = 0; r < count; ++r) {
    uint32_t i = sites_of[r];
    int32_t place;
    std::memcpy(&place, packed + order_offset + 4 * uint64_t(r), sizeof(place));
    if (place < 0 || uint64_t(place) < done[i] || uint64_t(place) >= taps[i]) return -1;
    places[r] = uint64_t(place);
    done[i] = uint64_t(place) + 1;
    rows[r] = next_row[i]++;
  }
  const tapd::GatheredSites sites{packed,     device,       rings,      site_ids,
                                  consumers,  everys,       first_leaf, nleaves,
                                  leaf_offsets, leaf_bytes, step_bytes, step_offsets};
  std::vector<uint64_t> lengths(nsites);
  for (uint32_t i = 0; i < nsites; ++i) lengths[i] = sites.Length(i);
  std::vector<uint64_t*> seq_of(nsites, nullptr);
  std::fill(done.begin(), done.end(), 0);
  auto skip = [&](uint32_t i, uint64_t upto) {
    if (upto > done[i] && rings[i] != nullptr) {
      tapd_ring_skip_many(rings[i], site_ids[i], consumers[i], device, upto - done[i]);
    }
    done[i] = upto;
  };
  size_t r = 0;
  while (r < size_t(count)) {
    uint32_t i = sites_of[r];
    skip(i, places[r]);  // the taps not kept before it: their seqs first
    done[i] = places[r] + 1;
    size_t end = r + 1;
    if (rings[i] == nullptr) {  // (the caller's: the sender's path)
      r = end;
      continue;
    }
    for (; end < size_t(count); ++end) {
      uint32_t j = sites_of[end];
      if (rings[j] != rings[i] || places[end] != done[j]) break;
      done[j] = places[end] + 1;
    }
    tapd::WriteRun(static_cast<Ring*>(rings[i]), sites, sites_of.data(), rows.data(),
                   lengths.data(), r, end, seq_of);
    r = end;
  }
  for (uint32_t i = 0; i < nsites; ++i) skip(i, taps[i]);
  return count;
}

// One record of one leaf (tests and benchmarks of the ring itself). Returns 0, or 1 if
// dropped.
int tapd_ring_write(void* handle, uint64_t site, uint32_t consumer, int32_t device,
                    int64_t step, const uint8_t* payload, uint64_t size) {
  const void* data[1] = {payload};
  return tapd::WriteLeaves(static_cast<Ring*>(handle),
                           tapd::RecordFields{site, consumer, device, step}, 1, data, &size);
}

uint64_t tapd_ring_record_header_bytes() { return sizeof(tapd::RecordHeader); }

// ---- For tests of the commit protocol only: a record reserved and filled now,
// committed or abandoned later (as a CUDA stream's host function would), or a bare
// reservation with no header at all (a writer killed right after reserving).

int tapd_ring_reserve_for_test(void* handle, uint64_t site, uint32_t consumer,
                               int32_t device, int64_t step, const uint8_t* payload,
                               uint64_t size, uint64_t* position) {
  auto* ring = static_cast<Ring*>(handle);
  uint64_t length = sizeof(tapd::RecordHeader) + tapd::Align8(size);
  uint8_t* out = tapd::BeginRecord(ring, length,
                                   tapd::RecordFields{site, consumer, device, step}, 1, 0,
                                   position);
  if (out == nullptr) return 1;
  if (size) std::memcpy(out + sizeof(tapd::RecordHeader), payload, size);
  return 0;
}

void tapd_ring_commit_for_test(void* handle, uint64_t position) {
  tapd::CommitRecord(static_cast<Ring*>(handle), position, 0);
}

void tapd_ring_abandon_for_test(void* handle, uint64_t position) {
  tapd::AbandonRecord(static_cast<Ring*>(handle), position);
}

// A CUDA stream's commit (ffi_cuda.cc), in its two halves. Enqueue: what the handler
// does on the host (the record marked kFlagDeviceCommit, and kFlagStep32 with the
// int32 `step` in the low half of `step` if `step32`; the tap counted; a sleeping
// reader woken). Store: what the device does, the low 32 bits of the commit tag and
// nothing else.
void tapd_ring_device_enqueue_for_test(void* handle, uint64_t position, int step32,
                                       int32_t step) {
  auto* ring = static_cast<Ring*>(handle);
  tapd::RecordHeader* h = tapd::HeaderAt(ring, position);
  h->flags |= tapd::kFlagDeviceCommit;
  if (step32) {
    h->flags |= tapd::kFlagStep32;
    h->step = int64_t(uint64_t(uint32_t(step)));
  }
  tapd::ApiDeviceCommitEnqueued(ring, position, h->length);
}

void tapd_ring_device_store_for_test(void* handle, uint64_t position) {
  auto* ring = static_cast<Ring*>(handle);
  uint64_t offset;
  uint64_t tag = tapd::ApiCommitTag(ring, position, &offset);
  __atomic_store_n(reinterpret_cast<uint32_t*>(ring->data + offset), uint32_t(tag),
                   __ATOMIC_RELEASE);
}

uint64_t tapd_ring_reserve_bare_for_test(void* handle, uint64_t length) {
  return tapd::Reserve(static_cast<Ring*>(handle), tapd::Align8(length));
}

}  // extern "C"
