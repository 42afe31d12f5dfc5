"""Coverage-guided fuzzing (atheris) of everything the daemon parses from peers:
message decoding (every kind, `taps` batches included), `.sites` files and their
entries, ring control pages and ring records. Not run in CI (docs/FUZZING.md).

    pip install atheris
    python fuzz/fuzz_protocol.py -atheris_runs=1000000 fuzz/corpus

The one allowed failure is `ProtocolError`: any other exception is a crash (a message
that would have killed the daemon), and atheris stops on it with the input saved.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import msgpack
    import numpy as np

    from tapd.errors import ProtocolError
    from tapd.protocol import MAGIC, decode, encode
    from tapd.protocol.batch import BatchTap, encode_batch
    from tapd.protocol.ring_checks import check_record, check_ring_control
    from tapd.protocol.schema import check_site_entry, split_site_entries
    from tapd.protocol.tree import unflatten

PAGE = 4096


def _seeds() -> list[bytes]:
    """Valid messages of each kind, so that mutation starts from deep inside."""
    tap = {"consumer": "loss", "seq": 3, "step": 1, "device": 0, "process": 0, "host": "h",
           "pid": 7, "time": 5, "transforms": [["batch", {"batch_dims": [0]}]],
           "meta": {"a": 1}, "tree": ["d", ["x", "y"], [["*"], ["t", [["*"], ["n"]]]]]}  # fmt: skip
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(2, dtype=np.int8)]
    messages = [
        encode("tap", tap, arrays),
        encode(
            "hello",
            {
                "role": "emitter",
                "host": "h",
                "pid": 1,
                "process": 0,
                "ring": "/d/1-ab.ring",
                "sites": "/d/1-ab.sites",
            },
        ),
        encode(
            "hello",
            {
                "role": "subscriber",
                "consumers": ["a", "b:*"],
                "window": 8,
                "name": "s",
                "batch": True,
            },
        ),
        encode("ack", {"upto": 4, "errors": [{"tid": 2, "error": "boom"}]}),
        encode("barrier", {"id": 1, "ring_position": 64}),
        encode("credit", {"bytes": 4}),
        encode("stats", {}),
    ]
    header = decode(encode("tap", tap, arrays)).header
    frames = [bytes(f) for f in encode("tap", tap, arrays)[2:]]
    messages.append(encode_batch([BatchTap(header, frames, 0, "h:7")]))
    return [_join([bytes(f) for f in m]) for m in messages]


def _join(frames: list[bytes]) -> bytes:
    """One input holding several frames: a selector byte, then each frame behind a
    2-byte length."""
    out = bytearray(b"\x00")
    for frame in frames:
        out += len(frame).to_bytes(2, "little") + frame
    return bytes(out)


def _split(data: bytes) -> list[bytes]:
    frames = []
    position = 0
    while position + 2 <= len(data):
        length = int.from_bytes(data[position : position + 2], "little")
        frames.append(data[position + 2 : position + 2 + length])
        position += 2 + length
    return frames


_UNPARSEABLE = object()


def _unpacked(body: bytes) -> object:
    """The harness's own msgpack parsing, for targets that take parsed values."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception:
        return _UNPARSEABLE


def _target(data: bytes) -> None:
    if not data:
        return
    selector, body = data[0] % 5, data[1:]
    try:
        if selector == 0:  # a multipart message
            message = decode(_split(body))
            if message.kind == "tap":
                message.value()
            for tap in message.batch:
                tap.value()
        elif selector == 1:  # a sites file
            entries, _ = split_site_entries(body)
            for entry in entries:
                check_site_entry(entry)
        elif selector == 2:  # one sites entry
            entry = _unpacked(body)
            if entry is not _UNPARSEABLE:
                check_site_entry(entry)
        elif selector == 3:  # a ring's control page, and a record against its leaves
            size = int.from_bytes(body[:8].ljust(8, b"\0"), "little")
            check_ring_control(body[8:], size, PAGE)
            check_record(len(body), [len(body) // 3, 5])
        else:  # a tree spec, rebuilt from as many leaves as it says
            spec = _unpacked(body)
            if spec is not _UNPARSEABLE:
                unflatten(spec, [0] * 8)  # type: ignore[arg-type]
    except ProtocolError:
        pass  # the one way bad input may end: rejected, with a reason


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    for directory in corpus:
        import pathlib

        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        for index, seed in enumerate(_seeds()):
            (path / f"seed{index}").write_bytes(seed)
            (path / f"seed{index}-sites").write_bytes(b"\x01" + _sites_seed())
    atheris.Setup(sys.argv, _target)
    atheris.Fuzz()


def _sites_seed() -> bytes:
    entry = {"site": 0, "consumer": "loss", "consumer_id": 0, "tree": ["*"], "meta": {},
             "transforms": [], "leaves": [["float32", [2], 8]]}  # fmt: skip
    packed = msgpack.packb(entry, use_bin_type=True)
    return len(packed).to_bytes(4, "little") + packed


if __name__ == "__main__":
    assert MAGIC
    main()
