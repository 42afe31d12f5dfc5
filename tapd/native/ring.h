// tapd's shared-memory ring: layout, record protocol, and the internal interface the
// XLA FFI handlers (ffi_cpu.cc, ffi_cuda.cc) write through. Needs only a C++17
// compiler and POSIX: no JAX, XLA or CUDA headers.
//
// Ring file layout (docs/PROTOCOL.md, "Shared-memory ring"):
//   [ RingControl: 4096 bytes ][ site table: kSiteSlots SiteSlots ][ capacity bytes of records ]
// The header area (control page and site table) is kHeaderBytes, or one page where
// pages are larger: the record area must start on a page boundary.
// The record area is mapped twice, back to back, so a record that crosses the end of
// the ring is still contiguous in memory: any record up to `capacity` bytes fits.
//
// Writers (XLA threads, CUDA host functions, the portable backend's callbacks; all in
// the one process that created the ring) reserve space with a CAS on `head`, mark the
// record reserved, fill it, and commit it by storing its commit tag with release order.
// Records commit in any order; a CUDA stream may store the tag itself (ffi_cuda.cc),
// with no host code running at the commit. Committers and readers then move
// `committed` over every consecutive committed record (a CAS), so a record is readable
// once it and every record before it is committed. The reader (the daemon) consumes [tail, committed) and
// advances `tail` only once the taps were delivered, so a daemon that dies loses
// nothing: its successor starts again from `tail`.

#ifndef TAPD_NATIVE_RING_H_
#define TAPD_NATIVE_RING_H_

#include <sys/socket.h>
#include <sys/un.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace tapd {

constexpr uint64_t kMagic = 0x31474e4952504154ULL;  // "TAPRING1"
// 2: the reader_sleeping flag and the wake socket.
// 3: per-record commit tags (out-of-order commits), the nonce, `abandoned`, the writer
//    lock, a 56-byte record header.
// 4: the site table (dormant and sampled taps), the `skipped` counter; records start
//    after a 65536-byte header area.
constexpr uint32_t kVersion = 4;
constexpr int64_t kNoStep = INT64_MIN;
constexpr uint32_t kReaderGathering = 2;  // RingControl::reader_sleeping
constexpr uint32_t kPolicyBlock = 0;
constexpr uint32_t kPolicyDropNewest = 1;

// Record header `flags`. Set by a writer while the record is being filled, cleared by
// a host commit. A commit written by a CUDA stream cannot clear them: a reader then sees
// kFlagStep32 and sign-extends the step itself (docs/PROTOCOL.md).
constexpr uint32_t kFlagStep32 = 1;  // `step` holds an int32 in its low 4 bytes
// Its commit tag is written by a CUDA stream, which wakes no reader: a reader that
// finds the record reserved polls for it instead of sleeping.
constexpr uint32_t kFlagDeviceCommit = 2;

// Commit tag states (the low 3 bits of a record's `commit` word; see Tag()).
constexpr uint64_t kTagReserved = 1;   // length valid; the rest is being written
constexpr uint64_t kTagCommitted = 2;  // whole: may be read
constexpr uint64_t kTagAbandoned = 3;  // never to be committed: skipped, counted

// The header area: the control page, then the site table (as many slots as fit).
constexpr uint64_t kHeaderBytes = 65536;
constexpr uint64_t kSiteTableOffset = 4096;
constexpr uint32_t kSiteSlots = 3840;

// A site's slot in the site table, slot i for site id i (ids are dense per emitter).
// `every` is written only by the daemon, `skipped` only by this process's writers. A
// writer takes its seq (per consumer and device, counting every execution), then copies
// the tap iff every != kEveryDormant and seq % (K * N) == 0, where K is the site's own
// `every=` and N the slot's (0 counts as 1). Otherwise it copies nothing and counts the
// tap here and in RingControl::skipped. Sites with id >= kSiteSlots are always sent.
constexpr uint32_t kEveryAll = 0;  // nobody has said (the zeroed default): send every tap
constexpr uint32_t kEveryDormant = 0xFFFFFFFFu;  // no taker: copy nothing
// Set in a writer's `every` (RecordFields::every, the handlers' `every` attribute) for a
// site marked `always` (id_tap's; TAPD_DORMANT=0): the slot is not read, only K applies.
constexpr uint64_t kEveryAlwaysBit = 0x8000000000000000ULL;
// `relied_on`: 1 while the emitter runs calls that skip the site's taps without reading
// `every` (a dormant call's twin executable: tapd/emitter/dormant_twin.py). The daemon
// that wakes such a site waits for the emitter to acknowledge the wake (set it back to 0)
// before it says the site is taken (a subscriber's welcome, its stats). Both sides store
// their own word, then load the other's, sequentially consistent: one of them sees the
// other (an emitter that sets it after the daemon's wake reads the wake, and relies on
// nothing). 0 in a ring no emitter of this kind wrote: nothing to wait for.
struct SiteSlot {
  std::atomic<uint32_t> every;
  std::atomic<uint32_t> relied_on;
  std::atomic<uint64_t> skipped;
};
static_assert(sizeof(SiteSlot) == 16, "a site slot is part of the format");
static_assert(kSiteSlots * sizeof(SiteSlot) == kHeaderBytes - kSiteTableOffset, "");

struct RingControl {
  uint64_t magic;
  uint32_t version;
  uint32_t policy;
  uint64_t capacity;
  int64_t writer_pid;
  uint64_t nonce;  // random per ring, mixed into every commit tag
  alignas(64) std::atomic<uint64_t> head;       // next byte to reserve
  alignas(64) std::atomic<uint64_t> committed;  // every byte below is readable
  alignas(64) std::atomic<uint64_t> tail;       // every byte below was delivered
  alignas(64) std::atomic<uint64_t> taps;       // committed tap records
  std::atomic<uint64_t> dropped;                // refused for lack of space
  std::atomic<uint64_t> blocked_ns;             // total time writers waited for space
  std::atomic<int64_t> reader_pid;              // the daemon draining it, 0 if none
  std::atomic<uint64_t> abandoned;              // reserved records never committed
  // Set by an idle daemon before it sleeps; a writer that commits and finds it set
  // clears it and sends a datagram to `wake.sock` beside the ring (see Wake). Or
  // kReaderGathering: a reader that lets taps gather, woken only once half the ring
  // waits for it (added within format 4: an older writer wakes it at once).
  alignas(64) std::atomic<uint32_t> reader_sleeping;
  // Why the daemon holds the oldest record it has not released (kHeld*), written by
  // the daemon when it changes (tapd/daemon/ring_source.py); a writer waiting for
  // space says it. 0 from a daemon that does not say. (Added within format 3: older
  // readers and writers ignore it.)
  alignas(64) std::atomic<uint32_t> held_reason;
  // Taps not copied because their site was dormant or sampled (SiteSlot), in all.
  alignas(64) std::atomic<uint64_t> skipped;
};
static_assert(sizeof(RingControl) <= kSiteTableOffset, "control block must fit its page");
// Read without mapping the ring: the first 32 bytes by tapd/protocol/schema.py
// (check_ring_control), reader_pid by tapd/daemon/ring_watch.py (sweep_stale_rings).
static_assert(offsetof(RingControl, writer_pid) == 24, "");
static_assert(offsetof(RingControl, reader_pid) == 280, "");

// RingControl::held_reason: what the daemon is waiting for before it releases `tail`.
constexpr uint32_t kHeldUnknown = 0;      // no daemon has said
constexpr uint32_t kHeldNotRead = 1;      // committed records not yet read by the daemon
constexpr uint32_t kHeldUnacked = 2;      // read, held for a subscriber that has not acked
constexpr uint32_t kHeldGrace = 3;        // held in the daemon's startup grace (no subscriber)
constexpr uint32_t kHeldQueueFull = 4;    // waiting for room in a subscriber's queue (block)
constexpr uint32_t kHeldSiteUnknown = 5;  // its site entry is not in the .sites file yet
constexpr uint32_t kHeldDetached = 6;     // the daemon let go of the ring (writer gone?)
constexpr uint32_t kHeldNothing = 7;      // everything read was delivered and released

// One record; 8-byte aligned; followed by the leaves' bytes, each padded to 8.
struct RecordHeader {
  uint32_t length;  // whole record, header included, multiple of 8
  uint32_t nleaves;
  uint64_t site;    // tap site id (registered in the emitter's .sites file)
  uint64_t seq;     // per (consumer, device), counting drops too: gaps are visible
  int64_t step;     // kNoStep if none
  int64_t time_ns;  // CLOCK_REALTIME
  int32_t device;
  uint32_t flags;   // kFlag*, writer-private: zero once committed
  uint64_t commit;  // commit tag: Tag(ring, position, state), stored with release order
};
static_assert(sizeof(RecordHeader) == 56, "the record header is part of the format");
static_assert(offsetof(RecordHeader, step) == 24, "");
static_assert(offsetof(RecordHeader, commit) == 48, "");

struct Ring {
  RingControl* control;
  SiteSlot* sites;  // kSiteSlots of them
  uint8_t* data;  // capacity bytes, mapped twice
  uint64_t capacity;
  size_t mapped;  // bytes of address space reserved
  // The ring file, open: the writer holds an exclusive flock on it for as long as it
  // lives (so that readers can tell a dead writer from a slow one, whatever the pid
  // namespace); a reader tests that lock with it.
  int fd = -1;
  bool writer = false;
  // This process's writers: the next seq per (consumer << 32 | device), and the lock
  // under which a writer takes its seq and its place in the ring (BeginRecord).
  std::mutex seq_mutex;
  std::unordered_map<uint64_t, uint64_t> seq;
  // The daemon's wake socket, beside the ring (writers only), and a socket to send on.
  sockaddr_un wake_address{};
  socklen_t wake_length = 0;
  std::atomic<int> wake_fd{-1};
  // Records begun by asynchronous writers (CUDA streams) whose commit has not run yet;
  // close waits for them. And what to do before unmapping (unregister pinned memory).
  std::atomic<int64_t> async_pending{0};
  // The end of the last record whose tag a CUDA stream writes (commit_tag): close
  // waits until `committed` passes it, as no host code runs at those commits.
  std::atomic<uint64_t> device_end{0};
  std::mutex hook_mutex;
  void (*close_hook)(void* ring) = nullptr;
  // How long a tap waits for space before it explains itself (TAPD_RING_WAIT_WARNING_S).
  int64_t wait_warning_ns = 5000000000LL;
  // The ids of this ring's sites by their entry, the handler's `entry` attribute
  // (docs/PROTOCOL.md, "The tap's custom call"): put by the emitter as it lowers a tap,
  // or asked of the site resolver when an entry is new here (a computation compiled
  // elsewhere: jax.export, the persistent compilation cache). Never erased: a new ring
  // (a new sites file) starts empty. `generation` tells thread caches apart.
  std::mutex entries_mutex;
  std::unordered_map<std::string, std::pair<uint64_t, uint32_t>> entries;
  uint64_t generation = 0;
};

inline uint64_t Align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// The commit word of the record at `position`, in `state`. The position makes a tag
// left over from an earlier lap of the ring differ from this lap's; the nonce makes
// leftover payload bytes equal to it as unlikely as guessing 61 random bits.
inline uint64_t Tag(const RingControl* c, uint64_t position, uint64_t state) {
  return ((position ^ c->nonce) & ~uint64_t{7}) | state;
}

inline RecordHeader* HeaderAt(Ring* ring, uint64_t position) {
  return reinterpret_cast<RecordHeader*>(ring->data + (position % ring->capacity));
}

// What a record is made of, for WriteLeaves (the FFI CPU handler, the portable
// backend, tests).
struct RecordFields {
  uint64_t site;
  uint32_t consumer;
  int32_t device;
  int64_t step;        // kNoStep if none
  // The site's own sampling K (tap(..., every=K); 0 counts as 1), with kEveryAlwaysBit
  // set for an `always` site.
  uint64_t every = 1;
};

// Whether the tap of `site` with this `seq` and the site's own `every` is copied (the
// SiteSlot rule). If not, it is counted as skipped, in its slot and in the ring.
bool TakeTap(Ring* ring, uint64_t site, uint64_t seq, uint64_t every);
// TakeTap's rule without its count, and the count: `taps` of `site` skipped.
bool TapWanted(Ring* ring, uint64_t site, uint64_t seq, uint64_t every);
void CountSkipped(Ring* ring, uint64_t site, uint64_t taps);

// Reserve a record of `length` bytes (header included) with its seq, and write its
// header, marked reserved, step and flags as given and time now. Returns its address,
// or nullptr if dropped or skipped (TakeTap; both counted, the seq used up all the same;
// `*skipped`, if given, says which). `*position` gets
// its ring position. The caller fills the leaves, then calls CommitRecord (or
// AbandonRecord) exactly once.
uint8_t* BeginRecord(Ring* ring, uint64_t length, const RecordFields& fields,
                     uint32_t nleaves, uint32_t flags, uint64_t* position,
                     bool* skipped = nullptr);
// Commit the record at `position` (time_ns: overwrite the header's time, 0 keeps it),
// move `committed` as far as it goes, wake a sleeping reader.
void CommitRecord(Ring* ring, uint64_t position, int64_t time_ns);
// Give up a reserved record: readers skip it, `abandoned` counts it.
void AbandonRecord(Ring* ring, uint64_t position);
// The whole record, synchronously: header, then each leaf padded to 8. Returns 0, 1 if
// dropped, or 3 if skipped (dormant or sampled out; nothing copied).
int WriteLeaves(Ring* ring, const RecordFields& fields, uint32_t nleaves,
                const void* const* data, const uint64_t* sizes);
// A process has two rings a tap may write to, named by the handler's `ring` attribute:
// the one its host's daemon drains (tapd_ring_install), and its local ring, drained by
// the process's own receiver thread for the tap functions that run in it
// (tapd_ring_install_local; tapd/emitter/local_path.py).
constexpr int32_t kRingDaemon = 0;
constexpr int32_t kRingLocal = 1;
// The ring `which` of this process, or nullptr (none installed, or no such ring).
Ring* InstalledRing(int32_t which = kRingDaemon);

// The ids of the site whose entry (the handler's `entry` attribute) is `entry`, in the
// ring `which`: known, or asked of the resolver the emitter set (tapd_set_site_resolver),
// which may install that ring first. Returns the ring, or nullptr with `*error` saying
// why (no resolver, or it refused the entry: a site of another process's own tap
// function, an entry of an unknown version, no ring to write).
Ring* SiteOfEntry(int32_t which, const char* entry, uint64_t length, uint64_t* site,
                  uint32_t* consumer, std::string* error);

// ---- The interface a separately built handler library (ffi_cuda.cc) writes through.
// It gets this table from tapd_ring_internal_api(), so that it uses this library's
// installed ring and seq counters rather than copies of its own.
// 2: set_install_hook, commit_tag, device_commit_enqueued (commits written by a stream).
// 3: begin takes the site's `every` and returns nullptr for a skipped tap too.
// 4: installed takes which ring (kRingDaemon, kRingLocal).
// 5: site_of_entry (the handler's `entry` attribute replaces `site` and `consumer`).
constexpr uint32_t kApiVersion = 5;
struct RingApi {
  uint32_t version;  // kApiVersion
  uint32_t size;     // sizeof(RingApi)
  void* (*installed)(int32_t which);
  // nullptr: dropped or skipped (dormant or sampled out), and counted: do nothing more.
  uint8_t* (*begin)(void* ring, uint64_t length, uint64_t site, uint32_t consumer,
                    int32_t device, uint32_t nleaves, int64_t step, uint32_t flags,
                    uint64_t every, uint64_t* position);
  void (*commit)(void* ring, uint64_t position, int64_t time_ns);
  void (*abandon)(void* ring, uint64_t position);
  // An asynchronous commit is on its way (begin it before the record's begin call
  // returns; end it after commit or abandon): close waits for it.
  void (*hold)(void* ring);
  void (*unhold)(void* ring);
  // The record area: its first byte and `capacity` (it is mapped again right after).
  uint8_t* (*records)(void* ring, uint64_t* capacity);
  // Called once, before the ring is unmapped.
  void (*set_close_hook)(void* ring, void (*hook)(void* ring));
  // Called with each ring tapd_ring_install installs (and at once with the one
  // installed now, if any): so that the CUDA library registers a ring when it is
  // attached, never inside a tap.
  void (*set_install_hook)(void (*hook)(void* ring));
  // A commit the device writes: the value whose low 32 bits, stored at the record's
  // `commit` word (`*offset` bytes into the record area, in its first mapping), commit
  // the record at `position` (its high 32 bits are already there: the reserved tag's).
  uint64_t (*commit_tag)(void* ring, uint64_t position, uint64_t* offset);
  // After the device's commit was enqueued: count the tap, note the record for close,
  // and wake a sleeping reader, which then polls until the tag lands.
  void (*device_commit_enqueued)(void* ring, uint64_t position, uint64_t length);
  // SiteOfEntry; `error` (of `error_size` bytes) gets the reason when it returns nullptr.
  void* (*site_of_entry)(int32_t which, const char* entry, uint64_t length, uint64_t* site,
                         uint32_t* consumer, char* error, uint64_t error_size);
};

}  // namespace tapd

extern "C" const tapd::RingApi* tapd_ring_internal_api(uint32_t version);

#endif  // TAPD_NATIVE_RING_H_
