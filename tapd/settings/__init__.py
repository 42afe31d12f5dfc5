"""Every tapd setting, declared once: its name, type, default, environment variable,
`tapd start` flag, which processes read it, and what it does.

The daemon's settings are the fields of `DaemonFields` (checked by `tapd.config.Config`);
the `tapd start` options and the TOML converter are made from them, so a new daemon
setting is one field here. The emitter's are the fields of `EmitterFields` (checked by
`tapd.emitter.settings.EmitterSettings`, set by `tapd.configure()`). The rest are read
where they are used, through `Setting.read`. `python -m tapd.settings --markdown` prints
the table of them all on docs/SETTINGS.md.

Every process reads this package (no JAX, no sockets); it imports nothing of tapd's but
errors and policies.
"""

# No `from __future__ import annotations`: the fields' types are read at run time.
import dataclasses
import os
from pathlib import Path
from typing import Literal

from tapd.policies import DaemonPolicy, Policy
from tapd.settings.setting import CLIENTS, EVERY_PROCESS, Setting, daemon, emitter, settings_of

Backend = Literal["auto", "native", "portable"]

SOCKET_NAME = "tapd.sock"
PIDFILE_NAME = "tapd.pid"

# ---- where the daemon lives ---------------------------------------------------------------

RUNTIME_DIR = Setting(
    "runtime_dir",
    Path | None,
    "the per-user 0700 directory of the daemon's socket, pidfile and log",
    EVERY_PROCESS,
    variable="TAPD_RUNTIME_DIR",
    default_text="$XDG_RUNTIME_DIR/tapd, else /tmp/tapd-$UID",
)


def runtime_dir() -> Path:
    """The runtime directory path (not created)."""
    if explicit := RUNTIME_DIR.read():
        return Path(explicit)
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "tapd"
    return Path(f"/tmp/tapd-{os.getuid()}")


def default_endpoint() -> str:
    return f"ipc://{runtime_dir() / SOCKET_NAME}"


def default_pidfile() -> Path:
    return runtime_dir() / PIDFILE_NAME


ENDPOINT = Setting(
    "endpoint",
    str,
    "the daemon's endpoint: where it listens, and where emitters, subscribers and the "
    "`tapd` command find it",
    EVERY_PROCESS,
    variable="TAPD_ENDPOINT",
    default_factory=default_endpoint,
    default_text="ipc://<runtime dir>/tapd.sock",
    flag="--endpoint",
    toml=True,
)

# A deprecated variable, read only through the settings that replace it (Setting.legacy).
POLICY = Setting(
    "policy",
    DaemonPolicy,
    "deprecated, as the daemon and emitters both read it: set TAPD_DAEMON_POLICY for the "
    "daemon and TAPD_EMITTER_POLICY for emitters",
    ("daemon", "emitter"),
    variable="TAPD_POLICY",
)

# Both sides read it: an emitter marks its sites `always` (never dormant, never thinned by
# the daemon), and a daemon with it off never makes a site dormant (docs/PROTOCOL.md,
# "Dormant and sampled taps").
DORMANT = Setting(
    "dormant",
    bool,
    "taps that no subscriber takes cost nothing (dormant sites copy nothing, counted as "
    "skipped); 0: every tap site is always sent and counted; the daemon reads it too "
    "(--no-dormant)",
    ("daemon", "emitter"),
    variable="TAPD_DORMANT",
    default=True,
    flag="--dormant",  # (and --no-dormant: a bool that defaults to on)
    toml=True,
)


# ---- the daemon (`tapd start`) --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DaemonFields:
    endpoint: str = ENDPOINT.field()
    dormant: bool = DORMANT.field()  # off: every site of every ring always wanted
    # Optional extra endpoint reachable from other hosts: CurveZMQ-authenticated (our
    # key pair in curve_secret_key, the peers we admit in curve_allowed), unless insecure.
    tcp: str | None = daemon(
        None,
        "also listen here for other hosts; CurveZMQ-authenticated (see --curve-secret-key, "
        "--curve-allowed) unless --insecure",
        metavar="tcp://HOST:PORT",
    )
    curve_secret_key: Path | None = daemon(
        None,
        "this daemon's key pair, from `tapd keygen` (for --tcp, and as its identity towards "
        "a --forward tcp:// upstream)",
        metavar="NAME.key_secret",
    )
    curve_allowed: Path | None = daemon(
        None, "directory of the NAME.key public keys of peers to admit", metavar="DIR"
    )
    insecure: bool = daemon(
        False,
        "let --tcp accept anyone who can reach it, and --forward tcp:// connect, "
        "unauthenticated and unencrypted",
    )
    # Forward every tap to the daemon at this endpoint, as well as to local subscribers.
    forward: str | None = daemon(
        None,
        "also send every tap on to the daemon at ENDPOINT (ipc://PATH, or tcp://HOST:PORT "
        "of its --tcp)",
        metavar="ENDPOINT",
        details="so that a job's subscribers can all connect to that one daemon; local "
        "subscribers still get theirs. Taps keep their emitter's identity and seq. Flow "
        "control runs end to end: what the upstream cannot take (or while it is not up "
        "yet) waits in this daemon's queue, under --policy. An emitter's barrier_wait() "
        "returns once the upstream's subscribers have handled its taps. tcp:// needs "
        "--forward-server-key and --curve-secret-key unless --insecure",
    )
    forward_server_key: Path | None = daemon(
        None,
        "the upstream daemon's public key, for --forward tcp://; the upstream admits this "
        "daemon by the public half of --curve-secret-key",
        metavar="NAME.key",
    )
    # What a full subscriber queue does; a full spool (or disk) falls back to spool_fallback.
    policy: DaemonPolicy = daemon(
        "block",
        "when a subscriber's queue is full: block (lossless, slows the emitters), "
        "drop_newest (counted), or spool (to an on-disk log per subscriber, delivered in "
        "order as it catches up; lossless without slowing the emitters until the spool is "
        "full, then --spool-fallback)",
        variable="TAPD_DAEMON_POLICY",
        legacy=POLICY,
    )
    spool_dir: Path | None = daemon(
        None,
        "where --policy spool keeps its logs, one directory per subscriber name; a daemon "
        "restarted on it delivers what an earlier one left there",
        default_text="~/.cache/tapd/spool/<endpoint hash>",
    )
    spool_bytes: int = daemon(
        10 * 2**30, "bound of each subscriber's spool, in bytes", default_text="10 GiB"
    )
    spool_fallback: Policy = daemon("block", "what a full spool (or a full disk) does")
    queue_bytes: int = daemon(
        256 * 10**6,
        "bound of each subscriber queue, in bytes of array payload",
        default_text="256 MB",
    )
    emitter_window_bytes: int = daemon(
        64 * 2**20,
        "bytes of taps an emitter may have sent that the daemon has not yet passed on",
        default_text="64 MiB",
    )
    subscriber_timeout: float = daemon(
        10.0, "drop a subscriber silent (no ack, no heartbeat) this many seconds"
    )
    startup_grace: float = daemon(
        2.0,
        "seconds after start in which taps no subscriber wants yet wait for one, and "
        "emitters' rings are not drained, so that subscribers can reconnect first",
    )
    drain_timeout: float = daemon(10.0, "on SIGTERM, keep delivering this many seconds")
    wake_ack_timeout: float = daemon(
        2.0,
        "seconds a subscriber's welcome waits for an emitter to acknowledge the wake of a "
        'site it runs a dormant twin of (docs/PROTOCOL.md, "Dormant taps and '
        'sampling"; within milliseconds where the emitter runs); past it the daemon '
        "names the ring in its log and welcomes the subscriber",
    )
    coalesce: float = daemon(
        0.002,
        "after a round that read only a few taps from the emitters' rings, wait this many "
        "seconds before the next: taps arriving a few thousand a second then go on many "
        "to a message, which costs the daemon and its subscribers less CPU a tap, and "
        "adds at most this much latency; 0 passes each round on at once",
    )
    max_message_bytes: int = daemon(
        2**30, "largest tap accepted, in bytes of array payload", default_text="1 GiB"
    )
    pidfile: Path | None = daemon(
        None, "where the daemon writes its pid", default_text="<runtime dir>/tapd.pid"
    )
    idle_exit: float | None = daemon(
        None,
        "stop (draining first, as `tapd stop` does) once there have been no emitters and "
        "no subscribers for this many seconds",
        default_text="600 for a daemon started on demand, else never",
    )
    # Set by tapd.autostart on the daemon it launches; `tapd status` shows it.
    started_by: int | None = daemon(
        None,
        "the pid of the client that started this daemon on demand (tapd sets it; such a "
        "daemon stops after --idle-exit seconds without clients)",
        metavar="PID",
    )
    log_level: str = daemon(
        "info",
        "debug, info, warning or error",
        readers=("daemon", "cli"),
        flag="--log-level",
        global_flag=True,
    )
    # ":PORT": every interface, as exporters do; port 0: any free one.
    metrics: str | None = daemon(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics: the counters and gauges of "
        "`tapd status --json`, per emitter and per subscriber (needs pip install "
        "'tapd[metrics]'). :PORT listens on every interface; port 0 picks a free one, "
        "shown by `tapd status`",
        metavar="HOST:PORT",
    )


def _named(settings: tuple[Setting, ...], name: str) -> Setting:
    return next(setting for setting in settings if setting.name == name)


DAEMON_SETTINGS = settings_of(DaemonFields)
LOG_LEVEL = _named(DAEMON_SETTINGS, "log_level")
PIDFILE = _named(DAEMON_SETTINGS, "pidfile")

CONFIG = Setting(
    "config",
    Path | None,
    "TOML file of daemon settings (a [daemon] table); TAPD_* variables and flags override it",
    ("daemon",),
    variable="TAPD_CONFIG",
    flag="--config",
)

# ---- the emitter (the JAX process; `tapd.configure()`) --------------------------------------


@dataclasses.dataclass(frozen=True)
class EmitterFields:
    endpoint: str = ENDPOINT.field()
    policy: Policy = emitter(
        "block",
        "when the emitter's buffer (or ring) is full: block (pauses the computation, "
        "lossless) or drop_newest (counted)",
        variable="TAPD_EMITTER_POLICY",
        legacy=POLICY,
    )
    backend: Backend = emitter(
        "auto",
        "native: the XLA FFI handler writes a shared-memory ring (CPU, GPU; daemon on this "
        "host); portable: jax.debug.callback; auto: native where it can be used",
    )
    buffer_bytes: int = emitter(
        256 * 10**6,
        "the emitter's own buffer (or ring), in bytes of payload (host_callback's 256 MB)",
        default_text="256 MB",
    )
    exit_timeout: float = emitter(
        10.0, "how long interpreter exit waits for taps to be delivered, in seconds"
    )
    cell_timeout: float = emitter(
        10.0,
        "how long a print to stdout (and, under IPython, the end of a cell) waits for the "
        "in-process callbacks of the computations before it to run, in seconds (a cell "
        "that reaches it says so; they run later); a progress bar's close waits for them "
        "until none has run for this long",
    )
    print_worker: Literal["auto", "never", "always"] = emitter(
        "auto",
        "where id_print's in-process sites render their arrays: auto: in a child process "
        "for a long run of taps (a loop that prints every step keeps its core and the GIL), "
        "else here; never: always here; always: in the child for every tap",
    )
    block_warning_after: float = emitter(
        5.0, "under block, warn when one tap has waited this long for buffer space", variable=None
    )
    dormant: bool = DORMANT.field()
    ordered: bool | Literal["strict"] = emitter(
        True,
        "taps keep program order inside each computation, whatever the data flows (tapd's "
        "own token, threaded through every loop, branch and call, on one device or "
        "several); strict: every tap takes "
        "JAX's ordered effect (order between computations too, at JAX's per-call cost); 0: "
        'lowered without one, order per site rebuilt from seq (docs/TAPPING.md, "Ordered, '
        'strict and unordered taps"); `tap(..., ordered=)` and `id_tap(..., ordered=)` '
        "override it",
    )
    gather: Literal["auto", "on", "off"] = emitter(
        "auto",
        "gather a computation's taps on the device and move them out in few host transfers "
        '(docs/TAPPING.md, "On a TPU"): auto: on a TPU, where each host callback is a '
        "transfer; on: wherever a tap would be a host callback (the portable backend; how "
        "the CPU tests the path); off: one host callback per tap",
    )
    gather_taps: int = emitter(
        1024,
        "a gathered computation flushes its taps to the host after at most this many "
        "(and, in a long loop on one device, within gather_latency), and at its end; "
        "one whose taps fit needs no host callback at all (on a TPU, ~1.7 ms a call less), "
        "nor does one whose taps are counted before it runs and fit gather_log_bytes, "
        "however many, where it does not run long",
    )
    gather_bytes: int = emitter(
        8 * 2**20,
        "the most device memory a gathered computation's tap buffers take, in bytes (a "
        "flush then comes after fewer taps; at least one), but for one whose taps fit "
        "gather_log_bytes",
        default_text="8 MiB",
    )
    gather_log_bytes: int = emitter(
        128 * 2**20,
        "a gathered computation whose taps are counted before it runs takes them all in "
        "one log where they pack into at most this many bytes of device memory: no flush, "
        "so no host callback, while it runs (on a TPU ~2 ms a call, run or not: "
        'docs/TAPPING.md, "On a TPU"); one larger, or one that may run long (a loop '
        "paced within gather_latency sends its log each chunk), flushes logs of "
        "gather_bytes",
        default_text="128 MiB",
    )
    gather_latency: float = emitter(
        0.25,
        "in a long loop, a gathered tap reaches the host within about this many seconds, "
        "whatever the loop's step time: the host paces the device's flushes from the time "
        'its steps take (docs/TAPPING.md, "Live loops"); 0: a loop flushes only when its '
        "log fills, and at the computation's end",
    )
    gather_fast_dispatch: bool = emitter(
        True,
        "a gathered computation whose taps leave as an output (one device, its taps "
        "counted before it runs, no flush while it runs) is served by JAX's C++ dispatch "
        "path from its second call on, as an untapped step is, while no consumer of it is "
        'sampled (docs/TAPPING.md, "On a TPU"); 0: JAX\'s Python path every call (~0.3 '
        "ms a call more on a TPU host)",
    )
    gather_dormant_twin: bool = emitter(
        True,
        "a computation on JAX's C++ path whose sites are all dormant, called often (8 "
        "calls in a row at most 5 ms apart), gets a twin compiled without its taps in a "
        "background thread, run while its sites stay dormant: a dormant call then costs "
        'what an untapped one does (docs/TAPPING.md, "On a TPU"); a wake is '
        "acknowledged before the daemon welcomes the subscriber that woke it; 0: never",
    )


CONNECT_TIMEOUT = Setting(
    "connect_timeout",
    float,
    "seconds a daemon that does not answer is waited for: before a tap function of this "
    "process fails at trace time, and before a wait on it (`barrier_wait`, the exit drain) "
    'fails where no daemon is started on demand (docs/PROMISES.md, "Faults")',
    ("emitter",),
    variable="TAPD_CONNECT_TIMEOUT",
    default=10.0,
)
AUTOSTART = Setting(
    "autostart",
    bool,
    "start a daemon on demand when the first emitter, subscriber, `tapd tail`, `subscribe` "
    "or `sink` finds none at the default endpoint (0: never; a missing daemon is then an "
    "error at once, as managed hosts want)",
    CLIENTS,
    variable="TAPD_AUTOSTART",
    default=True,
)
SHM_SUBSCRIBERS = Setting(
    "shm_subscribers",
    bool,
    "same-host subscribers of this user read large ring taps from the emitter's shared "
    "memory, sent a descriptor instead of the bytes (0: always over the socket; in a "
    "subscriber's environment, that subscriber only)",
    ("daemon", "subscriber"),
    variable="TAPD_SHM_SUBSCRIBERS",
    default=True,
)
LOCAL_FALLBACK = Setting(
    "local_fallback",
    bool,
    "run importable tap functions that no subscriber takes in the JAX process (0: only in "
    "subscriber processes; their taps count as unrouted meanwhile)",
    ("emitter",),
    variable="TAPD_LOCAL_FALLBACK",
    default=True,
)

# The native library reads these two itself (ring.cc, ffi_cuda.cc), in the JAX process.
CUDA_COMMIT = Setting(
    "cuda_commit",
    Literal["stream", "side", "host"] | None,
    "how a CUDA tap commits its ring record: stream (the stream writes the tag), side (a host "
    "function on a side stream), host (a host function on the computation's stream); for "
    "comparisons: `tapd doctor` says which one the GPU here gets, and why",
    ("emitter",),
    variable="TAPD_CUDA_COMMIT",
    default_text="stream where the driver has stream writes, else side",
)
RING_WAIT_WARNING = Setting(
    "ring_wait_warning",
    float,
    "seconds a tap waits for ring space before it says why the ring is full (head, tail, "
    "the oldest unreleased record and what holds it)",
    ("emitter",),
    variable="TAPD_RING_WAIT_WARNING_S",
    default=5.0,
)

# ---- clients of a tcp:// daemon ---------------------------------------------------------------

CURVE_SERVER_KEY = Setting(
    "curve_server_key",
    Path | None,
    "the daemon's public NAME.key, for a client of a tcp:// daemon (with TAPD_CURVE_SECRET)",
    CLIENTS,
    variable="TAPD_CURVE_SERVER_KEY",
)
CURVE_SECRET = Setting(
    "curve_secret",
    Path | None,
    "this client's NAME.key_secret, from `tapd keygen`, which the daemon admits by its "
    "NAME.key (with TAPD_CURVE_SERVER_KEY)",
    CLIENTS,
    variable="TAPD_CURVE_SECRET",
)

# ---- building the native library (setup.py, or on first use) --------------------------------
# tapd/native/build.py and setup.py read these themselves: setup.py runs without tapd.

XLA_FFI_INCLUDE = Setting(
    "xla_ffi_include",
    Path | None,
    "a directory with jaxlib's XLA FFI headers (xla/ffi/api/ffi.h) to build the CPU handler "
    "against",
    ("build",),
    variable="TAPD_XLA_FFI_INCLUDE",
    default_text="an importable jaxlib's",
)
CUDA_RUNTIME_DIR = Setting(
    "cuda_runtime_dir",
    Path | None,
    "a CUDA runtime (include/, and lib/ or lib64/ with libcudart.so.12 or .13) to build the "
    "CUDA handler against, and only it",
    ("build",),
    variable="TAPD_CUDA_RUNTIME_DIR",
    default_text="JAX's CUDA wheels, $CUDA_HOME, /usr/local/cuda",
)
BUILD_WITH_JAXLIB = Setting(
    "build_with_jaxlib",
    bool | None,
    "whether `pip install` asks for jaxlib, for its FFI headers (1 or 0)",
    ("build",),
    variable="TAPD_BUILD_WITH_JAXLIB",
    default_text="where jaxlib has wheels",
)
BUILD_JAXLIB = Setting(
    "build_jaxlib",
    str,
    "the jaxlib requirement that `pip install` asks for",
    ("build",),
    variable="TAPD_BUILD_JAXLIB",
    default="jaxlib>=0.6",
)

EMITTER_SETTINGS = settings_of(EmitterFields)


def _every_setting() -> tuple[Setting, ...]:
    """Each setting once (the endpoint is a field of both the daemon and the emitter)."""
    listed = [
        *DAEMON_SETTINGS,
        CONFIG,
        RUNTIME_DIR,
        *EMITTER_SETTINGS,
        CONNECT_TIMEOUT,
        AUTOSTART,
        LOCAL_FALLBACK,
        SHM_SUBSCRIBERS,
        CUDA_COMMIT,
        RING_WAIT_WARNING,
        CURVE_SERVER_KEY,
        CURVE_SECRET,
        XLA_FFI_INCLUDE,
        CUDA_RUNTIME_DIR,
        BUILD_WITH_JAXLIB,
        BUILD_JAXLIB,
        POLICY,
    ]
    return tuple(dict.fromkeys(listed))


SETTINGS = _every_setting()
