"""A tap site as its custom call carries it (tapd/emitter/entries.py): the versioned
entry format, and every way an entry from elsewhere (a `jax.export` artifact someone
hands over) can be wrong, refused with an error that says what. Then the handler's side,
in a real JAX process: an entry the resolver refuses fails the computation with the
resolver's words, and one new to the process is registered and its taps sent."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

import msgpack
import pytest

from conftest import wait_until
from tapd.emitter.entries import VERSION, EntryError, decode, encode

SITE = {"tree": ["*"], "meta": {}, "transforms": []}
LEAVES = [["float32", [4], 16]]


def packed(entry: object, prefix: str = VERSION) -> bytes:
    return f"{prefix}:".encode() + base64.b64encode(msgpack.packb(entry, use_bin_type=True))


@pytest.mark.fast  # starts no process (tests/conftest.py)
def test_an_entry_decodes_to_the_site_it_encodes() -> None:
    entry = encode("loss", SITE, LEAVES)
    assert entry.startswith("tapd1:")
    assert decode(entry.encode()) == ("loss", SITE, LEAVES)


@pytest.mark.fast  # starts no process (tests/conftest.py)
def test_the_entry_is_the_same_in_every_process() -> None:
    """(no pid, no registry number: the persistent cache's key depends on it)"""
    assert encode("loss", SITE, LEAVES) == encode("loss", dict(SITE), list(LEAVES))


@pytest.mark.fast
@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (b"tapd2:AAAA", "of format 'tapd2', which this tapd does not read"),
        (b"something else", "not a tapd site entry"),
        (b"tapd1:not base64!", "does not decode"),
        (packed([1, 2]), "not a map"),
        (packed({"leaves": LEAVES, **SITE}), "consumer is not a name: None"),
        (packed({"consumer": "x" * 300, "leaves": LEAVES}), "consumer is not a name"),
        (packed({"consumer": "a", "leaves": [["float32", [-1], 4]]}), "its leaves are not"),
        (packed({"consumer": "a", "leaves": "no"}), "its leaves are not"),
        (packed({"consumer": "a", "leaves": LEAVES, "shell": "rm"}), "does not know: ['shell']"),
    ],
)
def test_a_wrong_entry_is_refused_saying_what_is_wrong(entry: bytes, message: str) -> None:
    with pytest.raises(EntryError, match=re.escape(message)):
        decode(entry)


_HANDLER_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
import tapd
from tapd.emitter import exported

assert exported.register()  # (what a process that runs one compiled elsewhere does first)
results = {}
for name, entry in json.loads(sys.argv[1]).items():
    call = jax.jit(lambda x: (jax.ffi.ffi_call("tapd_tap", (), has_side_effect=True)(
        x, entry=entry, has_step=np.int64(0), every=np.int64(1), ring=np.int64(0)), x)[1])
    try:
        for _ in range(3):
            call(jnp.ones(4, jnp.float32)).block_until_ready()
        tapd.barrier_wait()
        results[name] = None
    except Exception as exc:
        results[name] = str(exc)
results["stats"] = tapd.stats()
print(json.dumps(results))
"""


def test_the_handler_registers_an_entry_new_here_and_fails_one_it_cannot_take(
    start_daemon: object, start_subscriber: object
) -> None:
    from tapd.native import library

    if not library.has_handler("cpu"):
        pytest.skip(f"no CPU FFI handler here: {library.handler_reason('cpu')}")
    daemon = start_daemon()  # type: ignore[operator]
    # A subscriber of the entry's consumer, so that the site is wanted and each call sent.
    # (Without one the daemon makes the new site dormant as soon as it reads it, which on
    # a loaded machine came before the first call ran: all three skipped, as they should.)
    subscriber = start_subscriber(daemon, "from.elsewhere")  # type: ignore[operator]
    cases = {
        "new_here": encode("from.elsewhere", SITE, LEAVES),
        "local": encode("local/vm:1/abcd/0/f", SITE, LEAVES),
        "future": "tapd9:AAAA",
    }
    result = subprocess.run(
        [sys.executable, "-c", _HANDLER_SCRIPT, json.dumps(cases)],
        env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.splitlines()[-1])
    assert got["new_here"] is None
    # The three calls of the site new here, each written and delivered.
    stats = got["stats"]
    assert (stats["sent"], stats["skipped"]) == (3, 0), f"{stats}"
    wait_until(lambda: len(subscriber.records()) == 3, "the three taps at the subscriber")
    assert "tap site 'local/vm:1/abcd/0/f' runs a tap function of the process" in got["local"]
    assert "of format 'tapd9', which this tapd does not read" in got["future"]
