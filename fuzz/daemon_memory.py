"""A live daemon's memory after a long run of fuzzed frames (docs/FUZZING.md, "The
daemon's memory after a fuzzing run"). Not run in CI.

    .venv/bin/python fuzz/daemon_memory.py --frames 1000000 --big-mib 100
    .venv/bin/python fuzz/daemon_memory.py --frames 1000000 --fresh-every 1 --per-connection 2
    .venv/bin/python fuzz/daemon_memory.py --frames 100000 --fresh-every 1 --trace 8

Starts a daemon in a child interpreter (this file with `--serve`: `tapd start` with a
hook on SIGUSR1 and SIGUSR2) and sends it `--frames` messages of every kind a daemon
takes, their fields drawn near valid ones and then mutated (fields replaced, added or
dropped; bytes flipped, cut or grown; frames added or lost), as tests/test_fuzz_daemon.py
does, from a seeded generator. One message in `--fresh-every` goes on a new connection
(`--per-connection` each, then closed: a new identity each time), the rest on two that
stay (which read what they are sent, unless `--no-read`). Then three messages of
`--big-mib` MiB of each oversized kind (tests/test_hostile_memory.py's four). It waits
until the daemon's per-peer tables are empty again, and prints one JSON object: the
daemon's RSS (VmRSS) at start, after a warm-up of `--warmup` messages, after the frames,
at its peak (VmHWM) and at the end; glibc's account at the end (mallinfo2: bytes in use,
free bytes it keeps, arenas); the RSS after `malloc_trim(0)`; Python containers of 10,000
items or more; and with `--trace N`, tracemalloc's largest growths from the warm-up to the
end, by traceback N frames deep (tracemalloc counts only what Python allocates, slows
the daemon down and fragments its heap with its own tables).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from tapd.clients import control
from tapd.errors import ProtocolError
from tapd.protocol import MAGIC, decode, encode
from tapd.protocol.batch import BatchTap, encode_batch

READY_PREFIX = "tapd ready:"
MiB = 1 << 20

# ---- the daemon's side: `--serve` ------------------------------------------------------


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(text.split(f"{field}:")[1].split()[0])


def _glibc() -> dict[str, Any]:
    """mallinfo2 (glibc 2.33 and later): what malloc holds, in use and free."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {
        "arena_mib": round(info.arena / MiB, 1),  # all arenas: taken from the system
        "mmapped_mib": round(info.hblkhd / MiB, 1),  # chunks of their own mmap
        "in_use_mib": round(info.uordblks / MiB, 1),  # all arenas
        "free_kept_mib": round(info.fordblks / MiB, 1),  # all arenas: freed, not returned
        "arenas": _arena_count(libc),
    }


def _arena_count(libc: ctypes.CDLL) -> int:
    """How many arenas malloc_info lists (one per thread that allocated, up to 8 per core)."""
    libc.open_memstream.restype = ctypes.c_void_p
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    text = ctypes.string_at(buffer, size.value).decode()
    libc.free(buffer)
    return text.count("<heap nr=")


def _mappings(top: int = 6) -> list[str]:
    """The daemon's largest mappings by resident size (/proc/self/smaps)."""
    found: list[tuple[int, str]] = []
    name = ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            name = f"{fields[0]} {fields[5] if len(fields) > 5 else '[anon]'}"
        elif fields and fields[0] == "Rss:":
            found.append((int(fields[1]), name))
    return [f"{kib / 1024:.1f} MiB {where}" for kib, where in sorted(found, reverse=True)[:top]]


def _large_containers(least: int = 10_000) -> list[dict[str, Any]]:
    """Lists, dicts, sets and tuples the collector tracks with `least` items or more, or
    holding a string of half a MiB or more, and what refers to each: where a table that
    grows would show."""
    out: list[dict[str, Any]] = []
    for obj in gc.get_objects():
        big = isinstance(obj, (list, dict, set, tuple)) and len(obj) >= least
        if not big and any(
            isinstance(v, (str, bytes, bytearray)) and len(v) > 50 * least
            for v in gc.get_referents(obj)
        ):
            big = True  # (holds a string of half a MiB or more)
        if big:
            referrers = [
                type(r).__qualname__ + (f" {sorted(r)[:6]!r:.200}" if isinstance(r, dict) else "")
                for r in gc.get_referrers(obj)
                if r is not out
            ]
            out.append({"id": id(obj), "type": type(obj).__name__, "items": len(obj),
                        "sample": repr(obj)[:120], "referrers": referrers[:4]})  # fmt: skip
    return out


def serve(argv: list[str], report: Path) -> int:
    """`tapd start ARGV` in this interpreter. SIGUSR1: remember the large containers
    and a tracemalloc snapshot (if tracing). SIGUSR2: write `report` (the containers
    that are new since, tracemalloc's growth since, glibc's account and the largest
    mappings, the RSS before and after malloc_trim(0))."""
    marked: list[tracemalloc.Snapshot] = []
    large_before: set[int] = set()

    def mark(*_: Any) -> None:
        large_before.update(c["id"] for c in _large_containers())
        if tracemalloc.is_tracing():
            marked[:] = [tracemalloc.take_snapshot()]

    def write_report(*_: Any) -> None:
        out: dict[str, Any] = {"rss_mib": round(rss_kib(os.getpid()) / 1024, 1)}
        out["gc_collected"] = gc.collect()  # (garbage in cycles is not held)
        if tracemalloc.is_tracing():
            now = tracemalloc.take_snapshot()
            current, peak = tracemalloc.get_traced_memory()
            out["traced_mib"] = round(current / MiB, 1)
            out["traced_peak_mib"] = round(peak / MiB, 1)
            if marked:
                stats = now.compare_to(marked[0], "traceback")
                out["traced_growth_mib"] = round(sum(s.size_diff for s in stats) / MiB, 2)
                out["largest_growths"] = [
                    {"kib": round(s.size_diff / 1024, 1), "blocks": s.count_diff,
                     "where": s.traceback.format(limit=4)}
                    for s in stats[:12]
                ]  # fmt: skip
        out["large_containers"] = [c for c in _large_containers() if c["id"] not in large_before]
        out["glibc"] = _glibc()
        out["mappings"] = _mappings()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["rss_after_trim_mib"] = round(rss_kib(os.getpid()) / 1024, 1)
        out["glibc_after_trim"] = _glibc()
        out["mappings_after_trim"] = _mappings()
        report.with_suffix(".part").write_text(json.dumps(out))
        report.with_suffix(".part").rename(report)

    signal.signal(signal.SIGUSR1, mark)
    signal.signal(signal.SIGUSR2, write_report)
    from tapd.cli.main import main

    return main(["start", *argv])


# ---- the fuzzer's side -----------------------------------------------------------------


class Messages:
    """Messages of every kind a daemon takes, near valid ones, then mutated: the same
    families as tests/test_fuzz_daemon.py's `structured` and `mutated`, from a seed."""

    KINDS = ["hello_emitter"] * 3 + ["hello_subscriber"] * 2 + ["tap"] * 3 + ["taps"] * 2 + [
        "credit", "ack", "ack", "barrier", "heartbeat", "bye", "stats", "welcome", "wants",
    ]  # fmt: skip

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def name(self) -> str:
        r = self.r
        if r.random() < 0.5:
            return r.choice(["", "x" * 300, "a\nb", "*", "loss", "probe", "h"])
        return "".join(r.choice("abcxyz:*0") for _ in range(r.randrange(1, 17)))

    def small_int(self) -> int:
        r = self.r
        return r.choice([r.randrange(-5, 2**31 + 5), r.randrange(0, 100), 2**40, 2**63 - 1])

    def value(self, depth: int = 0) -> Any:
        r = self.r
        pick = r.randrange(8 if depth < 2 else 6)
        if pick == 0:
            return None
        if pick == 1:
            return r.random() < 0.5
        if pick == 2:
            return self.small_int()
        if pick == 3:
            return r.random() * 1e6
        if pick == 4:
            return self.name()
        if pick == 5:
            return r.randbytes(r.randrange(12))
        if pick == 6:
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        return {self.name()[:6]: self.value(depth + 1) for _ in range(r.randrange(4))}

    def tree(self, depth: int = 0) -> list[Any]:
        r = self.r
        if depth > 2 or r.random() < 0.5:
            return r.choice([["*"], ["n"]])
        kids = [self.tree(depth + 1) for _ in range(r.randrange(1, 3))]
        kind = r.choice(["t", "d", "nt", "k"])
        keys = [r.choice(["a", "b", 0, 1, [0], {"k": 1}]) for _ in kids]
        if kind == "t":
            return ["t", kids]
        return ["d", keys, kids] if kind == "d" else [kind, "N", keys, kids]

    def tap_fields(self) -> dict[str, Any]:
        r = self.r
        return {"consumer": self.name(), "seq": self.small_int(), "step": self.small_int(),
                "device": r.choice([None, 0, self.small_int()]), "process": self.small_int(),
                "host": self.name(), "pid": self.small_int(), "time": self.small_int(),
                "transforms": r.choice([[], [["batch", {"batch_dims": [0]}]], [1]]),
                "meta": {self.name()[:4]: self.value() for _ in range(r.randrange(3))},
                "tree": self.tree()}  # fmt: skip

    def structured(self) -> list[bytes]:
        r = self.r
        kind = r.choice(self.KINDS)
        arrays = [np.arange(r.randrange(5), dtype=np.float32)]
        fields: dict[str, Any]
        if kind == "hello_emitter":
            fields = {"role": "emitter", "host": self.name(), "pid": self.small_int(),
                      "process": self.small_int()}  # fmt: skip
            if r.random() < 0.5:
                stem = r.choice(["/nowhere/1-ab", "", "/nowhere/x", "1-ab"])
                fields["ring"] = r.choice([f"{stem}.ring", ""])
                fields["sites"] = r.choice([f"{stem}.sites", "/dev/zero", "/etc/passwd"])
            kind = "hello"
        elif kind == "hello_subscriber":
            consumers = [self.name() for _ in range(r.randrange(4))]
            fields = {"role": "subscriber", "consumers": consumers, "window": self.small_int(),
                      "name": self.name(), "batch": r.random() < 0.5}  # fmt: skip
            extra = r.randrange(4)
            if extra == 1:
                fields["every"] = [[c, r.choice([1, 2, 3, 2**32 - 1])] for c in consumers[:2]]
            elif extra == 2:
                fields["group"] = self.name()
            elif extra == 3:
                fields["fallback"], fields["fallback_for"] = consumers[:1], self.name()
            kind = "hello"
        elif kind in ("tap", "taps"):
            fields = self.tap_fields()
        elif kind == "credit":
            fields = {"bytes": self.small_int()}
        elif kind == "ack":
            fields = {"upto": self.small_int(),
                      "errors": [{"tid": self.small_int(), "error": self.name()}]}  # fmt: skip
        elif kind == "barrier":
            fields = {"id": self.small_int(), "ring_position": self.small_int()}
        elif kind == "welcome":
            fields = {"window_bytes": 1, "daemon": "d"}
        elif kind == "wants":
            fields = {"patterns": [[self.name(), 1]], "everything": r.random() < 0.5}
        else:
            fields = {}
        mutation = r.choice(["none", "drop", "replace", "extra"])
        if fields and mutation == "drop":
            fields.pop(r.choice(sorted(fields)))
        elif fields and mutation == "replace":
            fields[r.choice(sorted(fields))] = self.value()
        elif mutation == "extra":
            fields[self.name()[:6]] = self.value()
        header = {**fields, "kind": kind}
        if kind == "tap":
            header["leaves"] = [["float32", [a.size], a.nbytes] for a in arrays]
            frames = [a.tobytes() for a in arrays]
            return [MAGIC, msgpack.packb(header, use_bin_type=True), *frames]
        if kind == "taps":
            try:
                message = decode(encode("tap", fields, arrays))
                batch = encode_batch([BatchTap(message.header, message.frames, 0, "h:1")])
                return [bytes(f) for f in batch]
            except Exception:
                return [MAGIC, msgpack.packb(header, use_bin_type=True), b""]
        return [MAGIC, msgpack.packb(header, use_bin_type=True)]

    def mutated(self) -> list[bytes]:
        r = self.r
        frames = [bytearray(f) for f in self.structured()]
        if r.random() < 0.25:
            return [bytes(f) for f in frames]  # (as drawn: many are well-formed)
        for _ in range(r.randrange(1, 4)):
            index = r.randrange(len(frames))
            frame = frames[index]
            action = r.choice(["flip", "cut", "add_frame", "drop_frame", "grow"])
            if action == "flip" and frame:
                frame[r.randrange(len(frame))] ^= r.randrange(1, 256)
            elif action == "cut" and frame:
                del frame[r.randrange(len(frame)) :]
            elif action == "add_frame":
                frames.append(bytearray(r.randbytes(r.randrange(17))))
            elif action == "drop_frame" and len(frames) > 1:
                frames.pop(index)
            elif action == "grow":
                frame += r.randbytes(r.randrange(1, 33))
        return [bytes(f) for f in frames]


class Fuzzer:
    def __init__(
        self,
        endpoint: str,
        seed: int,
        *,
        read: bool = True,
        fresh_every: int = 20,
        per_connection: int = 5,
    ) -> None:
        self.endpoint = endpoint
        self.read = read  # False: the staying connections never read what they are sent
        self.fresh_every = fresh_every
        self.per_connection = per_connection
        self.context = zmq.Context()
        self.messages = Messages(seed)
        self.staying = [self._socket() for _ in range(2)]
        self.sent = 0

    def _socket(self, context: zmq.Context[Any] | None = None) -> zmq.Socket[bytes]:
        sock = (context or self.context).socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(self.endpoint)
        return sock

    def run(self, frames: int, chunk: int = 2000) -> None:
        """`frames` messages: one in `fresh_every` on new connections (`per_connection`
        each, then closed), the rest on the two connections that stay; after each chunk,
        a stats request on each staying connection, whose answer says the daemon has
        read everything before it."""
        while frames > 0:
            count = min(chunk, frames, 200 * self.fresh_every * self.per_connection)
            new = -(-count // self.fresh_every // self.per_connection)
            context = zmq.Context()  # (term() below: their files closed before the next)
            fresh = [self._socket(context) for _ in range(new)]
            for i in range(count):
                message = self.messages.mutated()
                sock = self.staying[i % 2]
                if i % self.fresh_every == 0 or _asks_stats(message):  # (_sync: one answer)
                    sock = fresh[(i // self.fresh_every) % len(fresh)]
                sock.send_multipart(message)
            for sock in fresh:
                sock.close()
            context.term()
            if self.read:
                for sock in self.staying:
                    self._sync(sock)
            else:
                self._settle()
            frames -= count
            self.sent += count

    def _settle(self) -> None:
        """Without reading: until the daemon's counters stop moving (a few frames may
        still wait; the next chunk's settle takes them in)."""
        last = None
        while True:
            now = sum(control.stats(self.endpoint, timeout=30.0)["counters"].values())
            if now == last:
                return
            last = now
            time.sleep(0.2)

    def _sync(self, sock: zmq.Socket[bytes]) -> None:
        sock.send_multipart(encode("stats", {}))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if sock.poll(1000):
                frames = sock.recv_multipart()
                if len(frames) >= 2 and _kind(frames[1]) == "stats_reply":
                    return
        raise RuntimeError("the daemon did not answer a stats request in 120 s")

    def oversized(self, mib: int) -> None:
        """Three messages of `mib` MiB of each oversized kind (tests/test_hostile_memory.py)."""
        blob = bytes(mib * MiB)
        tap = msgpack.packb({**self.messages.tap_fields(), "kind": "tap",
                             "leaves": [["float32", [1], 4]]})  # fmt: skip
        hello = [bytes(f) for f in encode("hello", {"role": "subscriber", "consumers": ["x"],
                                                    "window": 1})]  # fmt: skip
        for message in ([blob, tap, b"xxxx"], [MAGIC, blob], [MAGIC, tap, blob], [*hello, blob]):
            sock = self._socket()
            for _ in range(3):
                sock.send_multipart(message, copy=False)
            self._sync(sock)
            sock.close()
        del blob

    def hang_up(self) -> None:
        """Close the connections that stayed (what the daemon keeps for them can go) and
        open new ones."""
        for sock in self.staying:
            sock.close(linger=0)
        self.staying = [self._socket() for _ in range(2)]

    def close(self) -> None:
        for sock in self.staying:
            sock.close(linger=0)
        self.context.term()


def _asks_stats(frames: list[bytes]) -> bool:
    try:
        return decode(frames).kind == "stats"
    except ProtocolError:
        return False


def _kind(header: bytes) -> Any:
    try:
        return msgpack.unpackb(header).get("kind")
    except Exception:
        return None


def tables(endpoint: str) -> dict[str, int]:
    stats = control.stats(endpoint, timeout=30.0)
    return {"emitters": len(stats["emitters"]), "subscribers": len(stats["subscribers"]),
            "reply_budgets": stats["bounds"]["reply_budgets"]}  # fmt: skip


def wait_empty(endpoint: str) -> dict[str, int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = tables(endpoint)
        if not any(now.values()):
            return now
        time.sleep(0.5)
    return tables(endpoint)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1_000_000)
    parser.add_argument("--warmup", type=int, default=20_000)
    parser.add_argument("--big-mib", type=int, default=100, help="0: no oversized messages")
    parser.add_argument("--trace", type=int, default=0, help="tracemalloc frames (0: off)")
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--no-read", action="store_true", help="staying connections never read")
    parser.add_argument("--fresh-every", type=int, default=20, help="1: every message")
    parser.add_argument("--per-connection", type=int, default=5)
    parser.add_argument("--serve", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        if args.trace:
            tracemalloc.start(args.trace)
        return serve(args.serve, Path(os.environ["FUZZ_MEMORY_REPORT"]))

    directory = Path(tempfile.mkdtemp(prefix="tapd-fm-", dir="/tmp"))
    endpoint = f"ipc://{directory}/tapd.sock"
    report = directory / "report.json"
    command = [sys.executable, __file__, "--trace", str(args.trace), "--serve", "--endpoint",
               endpoint, "--startup-grace", "0", "--subscriber-timeout", "1"]  # fmt: skip
    with open(directory / "daemon.log", "w") as log:
        daemon = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, "FUZZ_MEMORY_REPORT": str(report)},
        )
    out: dict[str, Any] = {"frames": args.frames, "warmup": args.warmup, "big_mib": args.big_mib,
                           "trace": args.trace,
                           "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX"),
                           "read": not args.no_read, "fresh_every": args.fresh_every,
                           "per_connection": args.per_connection}  # fmt: skip
    fuzzer = None
    try:
        assert daemon.stdout is not None
        line = daemon.stdout.readline()
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"the daemon did not start: {line!r}")
        pid = daemon.pid
        out["start_mib"] = round(rss_kib(pid) / 1024, 1)
        fuzzer = Fuzzer(
            endpoint,
            args.seed,
            read=not args.no_read,
            fresh_every=args.fresh_every,
            per_connection=args.per_connection,
        )
        started = time.monotonic()
        fuzzer.run(args.warmup)
        fuzzer.hang_up()
        out["tables_after_warmup"] = wait_empty(endpoint)
        out["after_warmup_mib"] = round(rss_kib(pid) / 1024, 1)
        os.kill(pid, signal.SIGUSR1)
        fuzzer.run(args.frames)
        out["after_frames_mib"] = round(rss_kib(pid) / 1024, 1)
        out["tables_after_frames"] = tables(endpoint)
        if args.big_mib:
            fuzzer.oversized(args.big_mib)
        out["seconds"] = round(time.monotonic() - started, 1)
        fuzzer.close()
        fuzzer = None
        out["tables"] = wait_empty(endpoint)
        counters = control.stats(endpoint, timeout=30.0)["counters"]
        out["rejected"] = sum(v for k, v in counters.items() if k.startswith("rejected_"))
        out["peak_mib"] = round(rss_kib(pid, "VmHWM") / 1024, 1)
        out["end_mib"] = round(rss_kib(pid) / 1024, 1)
        os.kill(pid, signal.SIGUSR2)
        deadline = time.monotonic() + 300
        while not report.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["daemon"] = json.loads(report.read_text())
    finally:
        if fuzzer is not None:
            fuzzer.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
