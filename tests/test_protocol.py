"""Tests for tapd.protocol (docs/PROTOCOL.md): pure encode/decode, tree specs, dtypes.

No sockets: frames are built with `encode` (or by hand) and fed to `decode` as the
bytes a ZeroMQ peer would deliver.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4 with numpy)
import msgpack
import numpy as np
import pytest

from tapd.errors import ProtocolError, TapDefinitionError, TapdError
from tapd.protocol import (
    MAGIC,
    VERSION,
    Limits,
    Message,
    decode,
    dtype_from_name,
    dtype_name,
    encode,
    flatten,
    unflatten,
)
from tapd.protocol.batch import (
    SPAN_BYTES,
    SPAN_GAP_BYTES,
    BatchRun,
    BatchTap,
    RingPiece,
    encode_batch,
    encode_ring_batch,
)
from tapd.protocol.dtypes import SUPPORTED_DTYPES, dtype_itemsize
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd.protocol.schema import KINDS_SCHEMA
from tapd.protocol.wire import KINDS

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

ALL_DTYPES = sorted(SUPPORTED_DTYPES)
Frames = list[Any]


# --------------------------------------------------------------------------- helpers


def tap_fields(**overrides: Any) -> dict[str, Any]:
    """A complete, valid set of `tap` fields (without `leaves`, which encode builds)."""
    fields: dict[str, Any] = {
        "consumer": "loss",
        "seq": 0,
        "step": None,
        "device": None,
        "process": 0,
        "host": "host0",
        "pid": 1234,
        "time": 1_700_000_000_000_000_000,
        "transforms": [],
        "meta": {},
        "tree": ["*"],
    }
    fields.update(overrides)
    return fields


def list_tree(count: int) -> list[Any]:
    """A tree spec for a flat list of `count` leaves."""
    return ["l", [["*"] for _ in range(count)]]


def wire(frames: Frames) -> Frames:
    """The frames as a receiver gets them: plain bytes, no views of the sender's arrays."""
    return [bytes(frame) for frame in frames]


def tap_frames(*arrays: np.ndarray, tree: list[Any] | None = None, **fields: Any) -> Frames:
    """Encoded `tap` frames carrying `arrays` (one leaf: tree `["*"]`; else a list)."""
    if tree is None:
        tree = ["*"] if len(arrays) == 1 else list_tree(len(arrays))
    return wire(encode("tap", tap_fields(tree=tree, **fields), arrays))


def roundtrip(*arrays: np.ndarray) -> list[np.ndarray]:
    """Encode `arrays` as one tap, decode it, and return the leaves `value()` rebuilds."""
    value = decode(tap_frames(*arrays, tree=list_tree(len(arrays)))).value()
    assert isinstance(value, list)
    return value


def header_of(frames: Frames) -> dict[str, Any]:
    return msgpack.unpackb(frames[1], raw=False)


def with_header(frames: Frames, edit: Callable[[dict[str, Any]], None]) -> Frames:
    """`frames` with the header unpacked, changed in place by `edit`, and repacked."""
    header = header_of(frames)
    edit(header)
    return [frames[0], msgpack.packb(header, use_bin_type=True), *frames[2:]]


def set_field(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        header[name] = value

    return edit


def del_field(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        del header[name]

    return edit


def set_leaf(index: int, position: int, value: Any) -> Callable[[dict[str, Any]], None]:
    """Edit leaf `index`'s entry: position 0 dtype, 1 shape, 2 nbytes."""

    def edit(header: dict[str, Any]) -> None:
        header["leaves"][index][position] = value

    return edit


def expect_error(frames: Frames, reason: str, limits: Limits | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        if limits is None:
            decode(frames)
        else:
            decode(frames, limits)
    assert info.value.reason == reason, str(info.value)
    assert str(info.value).startswith(f"{reason}: ")
    return info.value


def sample(name: str, shape: tuple[int, ...] = (3, 4)) -> np.ndarray:
    """A deterministic array of dtype `name` whose values fit every dtype (int4 too)."""
    size = math.prod(shape)
    index = np.arange(size)
    dtype = np.dtype(name)
    if name == "bool":
        values: np.ndarray = index % 3 == 0
    elif name.startswith("uint"):
        values = index % 16
    elif name.startswith("complex"):
        values = (index - 5) / 4 + 1j * (index % 5)
    elif name.startswith("int"):
        values = index % 14 - 7
    else:  # floats, bfloat16, float8_*: quarters in [-1.75, 1.5]
        values = (index % 14 - 7) / 4
    return values.astype(dtype).reshape(shape)


def assert_same_array(got: Any, expected: np.ndarray) -> None:
    """Exactly equal: same dtype, same shape, same bytes (C order)."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert got.tobytes() == expected.tobytes()


def assert_tree_equal(got: Any, expected: Any) -> None:
    """Structural equality where leaves are arrays (compared exactly) or scalars."""
    if isinstance(expected, np.ndarray):
        assert_same_array(got, expected)
    elif isinstance(expected, dict):
        assert type(got) is dict
        assert list(got) == list(expected)
        for key in expected:
            assert_tree_equal(got[key], expected[key])
    elif isinstance(expected, tuple) and hasattr(expected, "_fields"):
        assert isinstance(got, tuple)
        assert type(got).__name__ == type(expected).__name__
        assert got._fields == expected._fields
        for a, b in zip(got, expected, strict=True):
            assert_tree_equal(a, b)
    elif isinstance(expected, tuple | list):
        assert type(got) is type(expected)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_tree_equal(a, b)
    else:
        assert got == expected


# --------------------------------------------------------------------------- framing


def test_magic_and_version() -> None:
    assert VERSION == 1
    assert MAGIC == b"TAPD\x01"


def test_tap_frame_layout() -> None:
    a, b = sample("float32", (2, 3)), sample("int8", (5,))
    frames = encode("tap", tap_fields(tree=list_tree(2)), [a, b])
    assert len(frames) == 4
    assert bytes(frames[0]) == MAGIC
    assert header_of(frames)["leaves"] == [["float32", [2, 3], 24], ["int8", [5], 5]]
    assert bytes(frames[2]) == a.tobytes()
    assert bytes(frames[3]) == b.tobytes()


def test_decode_accepts_encode_output_directly() -> None:
    """encode's frames (memoryviews over the arrays) decode without a copy to bytes."""
    array = sample("float64", (4,))
    frames = encode("tap", tap_fields(), [array])
    assert_same_array(decode(frames).value(), array)


def test_decoded_message_exposes_header_and_frames() -> None:
    array = sample("int32", (2, 2))
    message = decode(tap_frames(array, seq=7, step=3, device=1, meta={"k": 1.5}))
    assert isinstance(message, Message)
    assert message.kind == "tap"
    assert message.header["seq"] == 7
    assert message.header["step"] == 3
    assert message.header["device"] == 1
    assert message.header["meta"] == {"k": 1.5}
    assert len(message.frames) == 1
    [decoded] = message.arrays()
    assert_same_array(decoded, array)


def test_tap_with_no_leaves() -> None:
    message = decode(wire(encode("tap", tap_fields(tree=["n"]), [])))
    assert message.header["leaves"] == []
    assert message.value() is None


def test_protocol_error_is_a_tapd_error() -> None:
    error = ProtocolError("bad_magic", "detail")
    assert isinstance(error, TapdError)
    assert (error.reason, error.detail) == ("bad_magic", "detail")


# --------------------------------------------------------------------------- arrays


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_roundtrip_every_dtype(name: str) -> None:
    array = sample(name)
    [got] = roundtrip(array)
    assert_same_array(got, array)
    assert dtype_name(got.dtype) == name


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_roundtrip_zero_d(name: str) -> None:
    array = sample(name, ())
    assert array.shape == ()
    [got] = roundtrip(array)
    assert got.shape == ()
    assert_same_array(got, array)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_roundtrip_empty(name: str) -> None:
    array = np.zeros((0, 3), dtype=name)
    frames = tap_frames(array)
    assert header_of(frames)["leaves"] == [[name, [0, 3], 0]]
    assert frames[2] == b""
    got = decode(frames).value()
    assert got.shape == (0, 3)
    assert_same_array(got, array)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_dtype_names_round_trip(name: str) -> None:
    dtype = dtype_from_name(name)
    assert dtype == np.dtype(name)
    assert dtype_name(dtype) == name
    assert dtype_itemsize(name) == dtype.itemsize  # (the table that header checks use)


NON_CONTIGUOUS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "step_slice": lambda a: a[::2],
    "column_slice": lambda a: a[:, 1:3],
    "transpose": lambda a: a.T,
    "negative_stride": lambda a: a[::-1],
    "negative_both": lambda a: a[::-1, ::-2],
    "transposed_reversed": lambda a: a.T[::-1],
    "broadcast_zero_stride": lambda a: np.broadcast_to(a[0], (3, 6)),
}


@pytest.mark.parametrize("name", ["float32", "int64", "bfloat16", "int4", "complex128"])
@pytest.mark.parametrize("view", list(NON_CONTIGUOUS), ids=list(NON_CONTIGUOUS))
def test_roundtrip_non_contiguous(view: str, name: str) -> None:
    base = sample(name, (4, 6))
    array = NON_CONTIGUOUS[view](base)
    assert not array.flags.c_contiguous
    [got] = roundtrip(array)
    assert got.flags.c_contiguous
    assert_same_array(got, np.ascontiguousarray(array))


def test_roundtrip_non_contiguous_leaves_input_untouched() -> None:
    base = sample("float32", (4, 6))
    before = base.copy()
    roundtrip(base.T, base[::-1])
    assert_same_array(base, before)


@pytest.mark.parametrize("code", [">f4", ">f8", ">i2", ">i8", ">u4", ">c8", ">c16", ">f2"])
def test_big_endian_arrives_little_endian(code: str) -> None:
    big = np.arange(-5, 7).reshape(3, 4).astype(code)
    assert big.dtype.byteorder == ">"
    little = big.astype(big.dtype.newbyteorder("<"))
    frames = tap_frames(big)
    assert frames[2] == little.tobytes()
    assert header_of(frames)["leaves"][0][0] == little.dtype.name
    got = decode(frames).value()
    assert got.dtype == np.dtype(code).newbyteorder("<")
    assert got.dtype.isnative
    assert_same_array(got, little)
    np.testing.assert_array_equal(got, big)


def test_big_endian_zero_d_and_non_contiguous() -> None:
    big = np.arange(24, dtype=">f4").reshape(4, 6)
    scalar = np.array(2.5, dtype=">f8")
    got_t, got_s = roundtrip(big.T[::-1], scalar)
    np.testing.assert_array_equal(got_t, big.T[::-1])
    assert got_t.dtype == np.dtype("<f4")
    assert got_s.shape == ()
    assert got_s.dtype == np.dtype("<f8")
    assert got_s == 2.5


REFUSED: dict[str, np.ndarray] = {
    "object": np.array([1, "a"], dtype=object),
    "void": np.zeros(2, dtype="V4"),
    "structured": np.zeros(2, dtype=[("a", "<i4")]),
    "str": np.array(["ab", "c"]),
    "bytes": np.array([b"ab", b"c"]),
    "datetime": np.array(["2024-01-01"], dtype="datetime64[D]"),
    "datetime_ns": np.zeros(3, dtype="datetime64[ns]"),
    "timedelta": np.zeros(3, dtype="timedelta64[s]"),
}


@pytest.mark.parametrize("kind", list(REFUSED), ids=list(REFUSED))
def test_encode_refuses_non_numeric_dtypes(kind: str) -> None:
    array = REFUSED[kind]
    with pytest.raises(ValueError, match="cannot be tapped") as info:
        encode("tap", tap_fields(), [array])
    assert repr(array.dtype) in str(info.value)


def test_encode_refuses_big_endian_str() -> None:
    array = np.array(["ab"], dtype=">U2")
    with pytest.raises(ValueError, match="cannot be tapped") as info:
        encode("tap", tap_fields(), [array])
    assert repr(array.dtype) in str(info.value)


def test_encode_refuses_unknown_kind_and_arrays_on_other_kinds() -> None:
    with pytest.raises(ValueError, match="nope"):
        encode("nope", {})
    with pytest.raises(ValueError, match="'bye' messages carry no arrays"):
        encode("bye", {}, [np.zeros(1)])


# --------------------------------------------------------------------------- tree specs

Point = collections.namedtuple("Point", ["x", "y"])


class Pair:
    """A pytree node the protocol does not know; the `custom` hook describes it."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first = first
        self.second = second


def describe_pair(node: Any) -> tuple[str, list[str], list[Any]] | None:
    if isinstance(node, Pair):
        return "Pair", [".first", ".second"], [node.first, node.second]
    return None


def test_flatten_nested_containers() -> None:
    a, b, c, d = (sample("float32", (2,)) + i for i in range(4))
    value = {"b": [a, None, (b, c)], "a": (d,), "z": None}
    spec, leaves = flatten(value)
    assert spec == [
        "d",
        ["a", "b", "z"],
        [
            ["t", [["*"]]],
            ["l", [["*"], ["n"], ["t", [["*"], ["*"]]]]],
            ["n"],
        ],
    ]
    assert [leaf is x for leaf, x in zip(leaves, [d, a, b, c], strict=True)] == [True] * 4
    assert_tree_equal(unflatten(spec, leaves), {"a": (d,), "b": [a, None, (b, c)], "z": None})


def test_flatten_empty_containers_and_bare_leaf() -> None:
    value = {"t": (), "l": [], "d": {}}
    spec, leaves = flatten(value)
    assert leaves == []
    assert unflatten(spec, []) == value
    leaf = sample("int8", (2,))
    spec, leaves = flatten(leaf)
    assert spec == ["*"]
    assert leaves[0] is leaf
    assert flatten(None) == (["n"], [])


def test_flatten_namedtuple() -> None:
    x, y = sample("float32", (2,)), sample("int32", ())
    spec, leaves = flatten(Point(x=x, y=y))
    assert spec == ["nt", "Point", ["x", "y"], [["*"], ["*"]]]
    rebuilt = unflatten(spec, leaves)
    assert type(rebuilt).__name__ == "Point"
    assert rebuilt._fields == ("x", "y")
    assert rebuilt.x is x
    assert rebuilt.y is y
    assert_tree_equal(rebuilt, Point(x, y))


def test_flatten_dict_with_int_keys() -> None:
    value = {10: "ten", 2: "two", -1: "minus one"}
    spec, leaves = flatten(value)
    assert spec == ["d", [-1, 2, 10], [["*"], ["*"], ["*"]]]
    assert leaves == ["minus one", "two", "ten"]
    assert unflatten(spec, leaves) == value


def test_flatten_dict_with_mixed_keys_puts_ints_first() -> None:
    spec, leaves = flatten({"b": 1, 3: 2, "a": 3, 1: 4})
    assert spec[1] == [1, 3, "a", "b"]
    assert leaves == [4, 2, 3, 1]


@pytest.mark.parametrize("key", [True, 1.5, ("a",), None, b"k"], ids=repr)
def test_flatten_refuses_other_dict_keys(key: Any) -> None:
    with pytest.raises(TapDefinitionError, match="cannot be tapped: only str and int keys"):
        flatten({key: 1})


def test_flatten_custom_node() -> None:
    a, b = sample("float16", (3,)), sample("uint8", (2,))
    spec, leaves = flatten({"p": Pair(a, [b, None])}, custom=describe_pair)
    assert spec == [
        "d",
        ["p"],
        [["k", "Pair", [".first", ".second"], [["*"], ["l", [["*"], ["n"]]]]]],
    ]
    assert leaves[0] is a
    assert leaves[1] is b
    assert_tree_equal(unflatten(spec, leaves), {"p": {".first": a, ".second": [b, None]}})


def test_flatten_without_custom_hook_treats_unknown_nodes_as_leaves() -> None:
    pair = Pair(1, 2)
    spec, leaves = flatten([pair])
    assert spec == ["l", [["*"]]]
    assert leaves == [pair]


def test_unflatten_leaf_count_must_match() -> None:
    spec = ["t", [["*"], ["*"]]]
    with pytest.raises(ProtocolError) as info:
        unflatten(spec, [1])
    assert info.value.reason == "bad_tree"
    with pytest.raises(ProtocolError) as info:
        unflatten(spec, [1, 2, 3])
    assert info.value.reason == "bad_tree"


def test_decode_tap_whose_tree_came_from_flatten() -> None:
    leaf = iter(sample(name, shape) for name, shape in [
        ("float32", (2, 3)), ("bfloat16", ()), ("int4", (0, 3)), ("bool", (4,)),
        ("complex64", (1,)), ("uint16", (2, 2)), ("float8_e5m2", (3,)),
    ])  # fmt: skip
    a, b, c, d, e, f, g = leaf
    value = {
        "params": [a, (b, None)],
        "point": Point(x=c, y={"inner": d}),
        "pair": Pair(e, [f]),
        7: g,
        "none": None,
    }
    spec, leaves = flatten(value, custom=describe_pair)
    message = decode(wire(encode("tap", tap_fields(tree=spec), leaves)))
    assert message.header["tree"] == spec
    expected = {
        7: g,
        "none": None,
        "pair": {".first": e, ".second": [f]},
        "params": [a, (b, None)],
        "point": Point(x=c, y={"inner": d}),
    }
    assert_tree_equal(message.value(), expected)


# --------------------------------------------------------------------------- other kinds

# Each kind's required fields and the types they take: the simple view of the schema.
SCHEMAS = {
    kind: {name: field.rule.types for name, field in fields.items() if field.required}
    for kind, fields in KINDS_SCHEMA.items()
}
MINIMAL_FIELDS: dict[str, dict[str, Any]] = {
    "hello": {"role": "emitter", "host": "h", "pid": 1},  # (a role's own fields: schema.py)
    "welcome": {"window_bytes": 1 << 20, "daemon": "d-1"},
    "rehello": {},
    "credit": {"bytes": 4096},
    "ack": {"upto": 3, "errors": []},
    "error": {"consumer": "loss", "seq": 0, "error": "boom", "subscriber": "sub"},
    "barrier": {"id": 1},
    "barrier_done": {"id": 1, "delivered": 2, "dropped": 0, "unrouted": 0},
    "wants": {"patterns": [["loss", 1], ["acts*", 10]]},
    "heartbeat": {},
    "bye": {},
    "stats": {},
    "stats_reply": {"stats": {"taps": 1}},
    "shutdown": {},
    # (a tap whose bytes stay in the ring: tapd_client/shm.py)
    "ring_tap": {**tap_fields(tree=["n"], leaves=[]), "ring": "1-a.ring", "positions": []},
}


def valid_fields(kind: str) -> dict[str, Any]:
    if kind == "taps":
        return {"statics": [], "taps": []}
    if kind == "ring_taps":
        return {"statics": [], "rings": [], "taps": []}
    return tap_fields(tree=["n"], leaves=[]) if kind == "tap" else dict(MINIMAL_FIELDS[kind])


def test_minimal_fields_cover_every_non_tap_kind() -> None:
    assert set(MINIMAL_FIELDS) == set(SCHEMAS) - {"tap", "taps", "ring_taps"}
    assert set(SCHEMAS) == KINDS
    for kind, fields in MINIMAL_FIELDS.items():
        assert set(fields) >= set(SCHEMAS[kind]), kind


@pytest.mark.parametrize("kind", sorted(MINIMAL_FIELDS))
def test_non_tap_kind_roundtrip(kind: str) -> None:
    fields = MINIMAL_FIELDS[kind]
    frames = encode(kind, fields)
    assert len(frames) == 2
    message = decode(wire(frames))
    assert message.kind == kind
    assert message.header == {"kind": kind, **fields}
    assert len(message.frames) == 0


def test_non_tap_kinds_ignore_unknown_extra_fields() -> None:
    fields = {"role": "subscriber", "consumers": ["a"], "window": 1, "x": 1}
    message = decode(wire(encode("hello", fields)))
    assert message.header["consumers"] == ["a"]
    assert message.header["x"] == 1


# --------------------------------------------------------------------------- strict decoding

REQUIRED_FIELDS = [(kind, name) for kind in sorted(SCHEMAS) for name in SCHEMAS[kind]]


def wrong_type_value(expected: type | tuple[type, ...]) -> Any:
    """A value of a type the schema entry does not accept."""
    accepted = expected if isinstance(expected, tuple) else (expected,)
    return [1] if str in accepted else "1"


def fields_frames(kind: str, fields: dict[str, Any]) -> Frames:
    """Frames for a header built verbatim (no `leaves` generation), with matching arrays."""
    body = [b""] if kind == "taps" else []  # a batch's (here empty) body frame
    return [MAGIC, msgpack.packb({"kind": kind, **fields}, use_bin_type=True), *body]


@pytest.mark.parametrize(("kind", "name"), REQUIRED_FIELDS, ids="-".join)
def test_missing_field(kind: str, name: str) -> None:
    fields = valid_fields(kind)
    decode(fields_frames(kind, fields))  # valid as given
    del fields[name]
    error = expect_error(fields_frames(kind, fields), "bad_field")
    assert repr(name) in str(error)


@pytest.mark.parametrize(("kind", "name"), REQUIRED_FIELDS, ids="-".join)
def test_wrong_field_type(kind: str, name: str) -> None:
    fields = valid_fields(kind)
    fields[name] = wrong_type_value(SCHEMAS[kind][name])
    error = expect_error(fields_frames(kind, fields), "bad_field")
    assert repr(name) in str(error)


INT_FIELDS = [
    pytest.param(kind, name, id=f"{kind}-{name}")
    for kind in sorted(SCHEMAS)
    for name, expected in SCHEMAS[kind].items()
    if expected is int
]


@pytest.mark.parametrize(("kind", "name"), INT_FIELDS)
@pytest.mark.parametrize("flag", [True, False])
def test_bool_is_not_an_int_field(kind: str, name: str, flag: bool) -> None:
    fields = valid_fields(kind)
    fields[name] = flag
    expect_error(fields_frames(kind, fields), "bad_field")


@pytest.mark.parametrize("name", ["step", "device"])
def test_optional_int_fields_accept_int_and_nil(name: str) -> None:
    for value in (None, 0, 5):
        message = decode(tap_frames(sample("int8", (1,)), **{name: value}))
        assert message.header[name] == value


@pytest.mark.parametrize("name", ["step", "device"])
def test_optional_int_fields_refuse_other_types(name: str) -> None:
    for value in ("1", 1.0, [1]):
        expect_error(tap_frames(sample("int8", (1,)), **{name: value}), "bad_field")


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([], id="no_frames"),
        pytest.param([b"garbage"], id="garbage_single_frame"),
        pytest.param([MAGIC], id="magic_only"),
        pytest.param([b"\x00" * 64], id="zero_bytes"),
    ],
)
def test_too_few_frames(frames: Frames) -> None:
    expect_error(frames, "bad_frames")


BYE_HEADER = msgpack.packb({"kind": "bye"})


@pytest.mark.parametrize(
    "magic",
    [b"XXXX\x01", b"tapd\x01", b"TAPD", b"TAPD\x01\x00", b"", b"TAP\x01"],
    ids=repr,
)
def test_bad_magic(magic: bytes) -> None:
    expect_error([magic, BYE_HEADER], "bad_magic")


@pytest.mark.parametrize("version", [0, 2, 255])
def test_bad_version(version: int) -> None:
    error = expect_error([b"TAPD" + bytes([version]), BYE_HEADER], "bad_version")
    assert str(version) in str(error)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="reserved_byte"),
        pytest.param(b"\x82\xa4kind", id="truncated_map"),
        pytest.param(b"not msgpack at all", id="text"),
        pytest.param(BYE_HEADER + b"\x00", id="trailing_bytes"),
        pytest.param(msgpack.packb({1: "bye", "kind": "bye"}), id="int_map_key"),
        pytest.param(msgpack.packb(["kind", "bye"]), id="list"),
        pytest.param(msgpack.packb("bye"), id="str"),
        pytest.param(msgpack.packb(7), id="int"),
        pytest.param(msgpack.packb(None), id="nil"),
        pytest.param(msgpack.packb({"kind": "nope"}), id="unknown_kind"),
        pytest.param(msgpack.packb({"kind": 1}), id="kind_not_str"),
        pytest.param(msgpack.packb({"kind": None}), id="kind_nil"),
        pytest.param(msgpack.packb({"role": "emitter"}), id="kind_missing"),
        pytest.param(msgpack.packb({"kind": b"bye"}, use_bin_type=True), id="kind_bin"),
    ],
)
def test_bad_header(header: bytes) -> None:
    expect_error([MAGIC, header], "bad_header")


def test_header_not_a_map_says_so() -> None:
    error = expect_error([MAGIC, msgpack.packb(["kind", "bye"])], "bad_header")
    assert "not a map" in str(error)


@pytest.mark.parametrize("extra", [[b"x"], [b""], [b"a", b"b"]], ids=["one", "empty", "two"])
@pytest.mark.parametrize("kind", sorted(MINIMAL_FIELDS))
def test_extra_frames_on_non_tap_kind(kind: str, extra: list[bytes]) -> None:
    frames = [*wire(encode(kind, MINIMAL_FIELDS[kind])), *extra]
    expect_error(frames, "bad_frames")


ONE_LEAF = tap_frames(sample("float32", (2, 3)))
TWO_LEAVES = tap_frames(sample("float32", (2, 3)), sample("int16", (4,)))


def truncated(frames: Frames, index: int, cut: int = 1) -> Frames:
    return [*frames[:index], frames[index][:-cut], *frames[index + 1 :]]


def padded(frames: Frames, index: int) -> Frames:
    return [*frames[:index], frames[index] + b"\x00", *frames[index + 1 :]]


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(truncated(ONE_LEAF, 2), id="truncated_frame"),
        pytest.param(truncated(TWO_LEAVES, 3, 2), id="truncated_second_frame"),
        pytest.param(padded(ONE_LEAF, 2), id="long_frame"),
        pytest.param([*ONE_LEAF[:2], b""], id="empty_frame"),
        pytest.param(with_header(ONE_LEAF, set_leaf(0, 2, 25)), id="nbytes_too_big"),
        pytest.param(with_header(ONE_LEAF, set_leaf(0, 2, 23)), id="nbytes_too_small"),
        pytest.param(with_header(ONE_LEAF, set_leaf(0, 2, -24)), id="nbytes_negative"),
        pytest.param(with_header(ONE_LEAF, set_leaf(0, 1, [2, 4])), id="shape_vs_frame"),
        pytest.param(with_header(ONE_LEAF, set_leaf(0, 0, "float64")), id="dtype_vs_frame"),
        pytest.param(
            with_header(padded(ONE_LEAF, 2), set_leaf(0, 2, 25)), id="nbytes_matches_frame_only"
        ),
        pytest.param(ONE_LEAF[:2], id="missing_frame"),
        pytest.param(TWO_LEAVES[:3], id="missing_second_frame"),
        pytest.param([*ONE_LEAF, ONE_LEAF[2]], id="extra_frame"),
        pytest.param([*ONE_LEAF, b""], id="extra_empty_frame"),
    ],
)
def test_tap_frames_must_match_leaves(frames: Frames) -> None:
    expect_error(frames, "bad_frames")


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param(["t", [["*"], ["*"]]], id="tree_wants_two"),
        pytest.param(["n"], id="tree_wants_none"),
        pytest.param(["l", []], id="empty_list"),
        pytest.param(["d", ["a", "b"], [["*"], ["*"]]], id="dict_wants_two"),
    ],
)
def test_leaf_count_must_match_tree(tree: list[Any]) -> None:
    expect_error(with_header(ONE_LEAF, set_field("tree", tree)), "bad_tree")


def test_tree_with_fewer_leaves_than_header() -> None:
    expect_error(with_header(TWO_LEAVES, set_field("tree", ["*"])), "bad_tree")


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param([], id="empty_node"),
        pytest.param([1], id="tag_not_str"),
        pytest.param(["?"], id="unknown_tag"),
        pytest.param(["*", 1], id="leaf_with_payload"),
        pytest.param(["n", []], id="none_with_payload"),
        pytest.param(["t"], id="tuple_without_children"),
        pytest.param(["t", ["*"]], id="child_not_a_node"),
        pytest.param(["t", "*"], id="children_not_list"),
        pytest.param(["l", [["*"], 5]], id="child_int"),
        pytest.param(["l", [["*"]], []], id="list_too_long"),
        pytest.param(["d", ["a"], []], id="dict_keys_vs_children"),
        pytest.param(["d", "a", [["*"]]], id="dict_keys_not_list"),
        pytest.param(["d", [1.5], [["*"]]], id="dict_float_key"),
        pytest.param(["d", [None], [["*"]]], id="dict_nil_key"),
        pytest.param(["nt", 3, ["x"], [["*"]]], id="namedtuple_name_not_str"),
        pytest.param(["nt", "P", [1], [["*"]]], id="namedtuple_field_not_str"),
        pytest.param(["nt", "P", ["x", "y"], [["*"]]], id="namedtuple_fields_vs_children"),
        pytest.param(["k", "K", [1], [["*"]]], id="custom_path_not_str"),
        pytest.param(["k", None, ["a"], [["*"]]], id="custom_name_nil"),
        pytest.param(["k", "K", ["a"]], id="custom_too_short"),
        pytest.param(["t", [["l", [["d", ["a"], [["?"]]]]]]], id="deep_bad_node"),
    ],
)
def test_malformed_tree(tree: list[Any]) -> None:
    expect_error(with_header(ONE_LEAF, set_field("tree", tree)), "bad_tree")


def nested_tuples(depth: int) -> list[Any]:
    """A leaf inside `depth` nested tuples: the leaf sits at depth `depth`."""
    tree: list[Any] = ["*"]
    for _ in range(depth):
        tree = ["t", [tree]]
    return tree


@pytest.mark.parametrize("max_depth", [0, 3, 10])
def test_tree_depth_limit(max_depth: int) -> None:
    limits = Limits(max_tree_depth=max_depth)
    at_limit = with_header(ONE_LEAF, set_field("tree", nested_tuples(max_depth)))
    decode(at_limit, limits)
    too_deep = with_header(ONE_LEAF, set_field("tree", nested_tuples(max_depth + 1)))
    expect_error(too_deep, "bad_tree", limits)


def test_default_tree_depth_limit() -> None:
    decode(with_header(ONE_LEAF, set_field("tree", nested_tuples(64))))
    expect_error(with_header(ONE_LEAF, set_field("tree", nested_tuples(65))), "bad_tree")


def test_header_size_limit() -> None:
    frames = wire(encode("bye", {"padding": "x" * 200}))
    size = len(frames[1])
    decode(frames, Limits(max_header_bytes=size))
    error = expect_error(frames, "too_large", Limits(max_header_bytes=size - 1))
    assert str(size) in str(error)


def test_header_size_limit_is_checked_before_parsing() -> None:
    expect_error([MAGIC, b"\xc1" * 101], "too_large", Limits(max_header_bytes=100))


def test_message_size_limit_single_leaf() -> None:
    frames = tap_frames(np.zeros(64, dtype=np.float32))  # 256 bytes
    decode(frames, Limits(max_message_bytes=256))
    expect_error(frames, "too_large", Limits(max_message_bytes=255))


def test_message_size_limit_counts_all_leaves() -> None:
    frames = tap_frames(np.zeros(32, np.float32), np.zeros(32, np.float32))  # 2 x 128 bytes
    decode(frames, Limits(max_message_bytes=256))
    expect_error(frames, "too_large", Limits(max_message_bytes=200))


def test_leaf_count_limit() -> None:
    frames = tap_frames(*(np.zeros(1, np.int8) for _ in range(3)))
    decode(frames, Limits(max_leaves=3))
    expect_error(frames, "too_large", Limits(max_leaves=2))


@pytest.mark.parametrize(
    "name",
    ["float128", "complex256", "object", "str", "<f4", "Float32", "float32 ", "", 7, None],
    ids=repr,
)
def test_unknown_dtype_name(name: Any) -> None:
    error = expect_error(with_header(ONE_LEAF, set_leaf(0, 0, name)), "bad_dtype")
    assert repr(name) in str(error)


def test_dtype_from_name_refuses_unknown() -> None:
    with pytest.raises(ProtocolError) as info:
        dtype_from_name("float128")
    assert info.value.reason == "bad_dtype"


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param([-1], id="negative"),
        pytest.param([2, -3], id="negative_second"),
        pytest.param([-2, -3], id="two_negatives"),
        pytest.param([True, 6], id="bool_dim"),
        pytest.param([2.0, 3], id="float_dim"),
        pytest.param(["2", 3], id="str_dim"),
        pytest.param([None], id="nil_dim"),
        pytest.param("6", id="shape_str"),
        pytest.param(6, id="shape_int"),
        pytest.param({"0": 6}, id="shape_map"),
    ],
)
def test_bad_shape(shape: Any) -> None:
    expect_error(with_header(ONE_LEAF, set_leaf(0, 1, shape)), "bad_field")


def test_ndim_limit() -> None:
    frames = tap_frames(np.zeros((1, 1, 1), np.int8))
    decode(frames, Limits(max_ndim=3))
    expect_error(frames, "bad_field", Limits(max_ndim=2))


@pytest.mark.parametrize(
    "leaf",
    [
        pytest.param(["float32", [2, 3]], id="two_items"),
        pytest.param(["float32", [2, 3], 24, 0], id="four_items"),
        pytest.param("float32", id="str"),
        pytest.param({"dtype": "float32"}, id="map"),
        pytest.param(None, id="nil"),
    ],
)
def test_malformed_leaf_entry(leaf: Any) -> None:
    def edit(header: dict[str, Any]) -> None:
        header["leaves"][0] = leaf

    expect_error(with_header(ONE_LEAF, edit), "bad_field")


def test_negative_seq() -> None:
    expect_error(tap_frames(sample("int8", (1,)), seq=-1), "bad_field")


def test_tap_missing_leaves_built_by_hand() -> None:
    expect_error(with_header(ONE_LEAF, del_field("leaves")), "bad_field")


# ------------------------------------------------------- regressions (found by these tests)
# Each test below pins a rule of docs/PROTOCOL.md an earlier decoder broke.


@pytest.mark.parametrize("name", ["step", "device"])
def test_bool_refused_for_optional_int(name: str) -> None:
    expect_error(tap_frames(sample("int8", (1,)), **{name: True}), "bad_field")


@pytest.mark.parametrize("nbytes", [True, 1.0, "24"], ids=repr)
def test_mistyped_nbytes_refused(nbytes: Any) -> None:
    frames = with_header(tap_frames(np.zeros((), np.bool_)), set_leaf(0, 2, nbytes))
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.reason in ("bad_field", "bad_frames")


@pytest.mark.parametrize(
    "tree",
    [
        pytest.param(["d", ["a", "a"], [["*"], ["*"]]], id="dict"),
        pytest.param(["k", "K", [".a", ".a"], [["*"], ["*"]]], id="custom"),
    ],
)
def test_duplicate_tree_keys_refused(tree: list[Any]) -> None:
    frames = tap_frames(np.zeros(1), np.ones(1), tree=tree)
    expect_error(frames, "bad_tree")


def test_bool_dict_key_refused() -> None:
    frames = tap_frames(np.zeros(1), tree=["d", [True], [["*"]]])
    expect_error(frames, "bad_tree")


# --------------------------------------------------------------------------- shard field


def shard_field(**overrides: Any) -> dict[str, Any]:
    """A valid `shard` for one f32[2, 3] leaf: block (0, 1) of a 2x2 mesh tiling [4, 6]."""
    shard: dict[str, Any] = {"axes": ["a", "b"], "sizes": [2, 2], "coords": [0, 1],
                             "layout": [[[4, 6], [["a"], ["b"]]]]}  # fmt: skip
    shard.update(overrides)
    return shard


def test_a_valid_shard_field_is_kept() -> None:
    message = decode(tap_frames(sample("float32", (2, 3)), shard=shard_field()))
    assert message.header["shard"] == shard_field()


def test_shard_may_be_nil_or_absent() -> None:
    assert decode(tap_frames(sample("float32"), shard=None)).header["shard"] is None
    assert "shard" not in decode(tap_frames(sample("float32"))).header


BAD_SHARDS: dict[str, Any] = {
    "not a map": [1, 2],
    "lengths differ": shard_field(coords=[0]),
    "coordinate past the axis": shard_field(coords=[0, 2]),
    "negative coordinate": shard_field(coords=[-1, 0]),
    "bool coordinate": shard_field(coords=[True, 0]),
    "repeated axis": shard_field(axes=["a", "a"]),
    "axis not a str": shard_field(axes=["a", 3]),
    "layout per leaf": shard_field(layout=[]),
    "layout entry shape": shard_field(layout=[[[4, 6]]]),
    "dims and shape disagree": shard_field(layout=[[[4, 6], [["a"]]]]),
    "unknown axis": shard_field(layout=[[[4, 6], [["a"], ["z"]]]]),
    "extent not divisible": shard_field(layout=[[[5, 6], [["a"], ["b"]]]]),
    "block does not hold the leaf": shard_field(layout=[[[4, 4], [["a"], ["b"]]]]),
    "missing layout": {"axes": ["a"], "sizes": [2], "coords": [0]},
    "axis splits two dims": shard_field(layout=[[[4, 6], [["a"], ["a"]]]]),
}


@pytest.mark.parametrize("shard", list(BAD_SHARDS.values()), ids=list(BAD_SHARDS))
def test_bad_shard_fields_are_refused(shard: Any) -> None:
    frames = tap_frames(sample("float32", (2, 3)), shard=shard_field())
    expect_error(with_header(frames, set_field("shard", shard)), "bad_shard")


# --------------------------------------------------------------------------- taps batches


def batch_of(*arrays: np.ndarray, shard: Any = None) -> Frames:
    """A `taps` message with one single-leaf tap per array: seq 0, 1, ..., one site."""
    taps = []
    for seq, array in enumerate(arrays):
        fields = tap_fields(seq=seq) if shard is None else tap_fields(seq=seq, shard=shard)
        frames = encode("tap", fields, [array])
        header = header_of(wire(frames))
        taps.append(BatchTap(header, frames[2:], tid=100 + seq, emitter="h:1", site=None))
    return wire(encode_batch(taps))


def test_a_batch_decodes_to_its_taps_in_order_with_padding_between_them() -> None:
    arrays = [sample("int8", (3,)), sample("float64", (2, 2)), sample("bool", (0,))]
    message = decode(batch_of(*arrays))
    assert message.kind == "taps" and len(message.frames) == 1
    assert len(message.header["statics"]) == 3  # shapes differ: three statics
    assert [tap.header["seq"] for tap in message.batch] == [0, 1, 2]
    assert [tap.header["tid"] for tap in message.batch] == [100, 101, 102]
    for tap, array in zip(message.batch, arrays, strict=True):
        assert tap.kind == "tap" and tap.header["emitter"] == "h:1"
        assert tap.header["consumer"] == "loss"
        assert_same_array(tap.value(), array)


def test_taps_of_one_site_share_one_static_entry() -> None:
    message = decode(batch_of(*[sample("float32", (2,))] * 5))
    assert len(message.header["statics"]) == 1 and len(message.batch) == 5


def test_shard_coordinates_travel_per_tap_and_the_layout_once() -> None:
    arrays = [sample("float32", (2, 3))] * 2
    message = decode(batch_of(*arrays, shard=shard_field()))
    [static] = message.header["statics"]
    assert "coords" not in static["shard"]
    assert all(tap.header["shard"] == shard_field() for tap in message.batch)


BAD_BATCHES: dict[str, Callable[[dict[str, Any]], None]] = {
    "static lacks a field": lambda h: h["statics"][0].pop("consumer"),
    "static leaf size": lambda h: h["statics"][0]["leaves"][0].__setitem__(1, [3]),
    "static not a map": lambda h: h["statics"].__setitem__(0, 7),
    "row too short": lambda h: h["taps"][0].pop(),
    "row names no static": lambda h: h["taps"][0].__setitem__(0, 5),
    "negative seq": lambda h: h["taps"][0].__setitem__(2, -1),
    "bool device": lambda h: h["taps"][0].__setitem__(4, True),
    "coordinates on an unsharded tap": lambda h: h["taps"][0].__setitem__(6, [0]),
}
BAD_BATCH_REASONS = {"coordinates on an unsharded tap": "bad_shard",
                     "static leaf size": "bad_frames"}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_bad_batches_are_refused(name: str) -> None:
    frames = batch_of(sample("float32", (2,)), sample("float32", (2,)))
    expect_error(with_header(frames, BAD_BATCHES[name]), BAD_BATCH_REASONS.get(name, "bad_field"))


def test_bad_shard_coordinates_in_a_batch_are_refused() -> None:
    frames = batch_of(sample("float32", (2, 3)), shard=shard_field())
    expect_error(with_header(frames, lambda h: h["taps"][0].__setitem__(6, [0, 2])), "bad_shard")


def test_a_batch_body_must_hold_its_taps_without_overlap() -> None:
    frames = batch_of(sample("float32", (2,)), sample("float32", (2,)))
    decode([*frames[:2], frames[2] + bytes(8)])  # bytes past (or between) taps: ignored
    expect_error([*frames[:2], frames[2][:12]], "bad_frames")  # the second tap overruns
    expect_error(with_header(frames, lambda h: h["taps"][1].__setitem__(8, 0)), "bad_frames")
    expect_error(with_header(frames, lambda h: h["taps"][1].__setitem__(7, 1)), "bad_frames")
    expect_error(frames[:2], "bad_frames")  # no body at all


def test_a_run_travels_as_its_own_body_frame_gaps_and_all() -> None:
    """Ring records as they are: a 48-byte record header before each tap's leaves."""
    header = header_of(wire(encode("tap", tap_fields(), [np.zeros(2, np.float32)])))
    values = [np.array([i, -i], np.float32) for i in range(3)]
    body = b"".join(bytes(48) + v.tobytes() for v in values)
    run = BatchRun(header, body, offsets=[48, 104, 160], first_tid=7, emitter="h:1",
                   site="site", seqs=[0, 1, 2], steps=[5, 6, None], devices=[0, 0, 0],
                   times=[1, 2, 3])  # fmt: skip
    one = np.ones(1, np.int8)
    single_header = header_of(wire(encode("tap", tap_fields(), [one])))
    single = BatchTap(single_header, [one.tobytes()], tid=10, emitter="h:1")
    message = decode(wire(encode_batch([run, single])))
    assert len(message.frames) == 2  # the copied singles' body, then the run's
    got = [(t.header["tid"], t.header["seq"], t.header["step"], t.value().tolist())
           for t in message.batch]  # fmt: skip
    assert got == [(7, 0, 5, [0.0, 0.0]), (8, 1, 6, [1.0, -1.0]), (9, 2, None, [2.0, -2.0]),
                   (10, 0, None, [1])]  # fmt: skip


def test_batch_size_is_bounded() -> None:
    frames = batch_of(*[sample("int8", (1,))] * 3)
    expect_error(frames, "too_large", Limits(max_batch=2))


# --------------------------------------------------------------------------- ring_taps

RECORD_HEADER = 56  # bytes before each tap's leaves in a ring (ring.h): a gap between taps


def ring_piece(
    positions: list[int],
    *,
    ring: str = "12-ab.ring",
    first_tid: int = 100,
    shape: tuple[int, ...] = (2,),
    shard: Any = None,
    site: str = "site",
) -> RingPiece:
    """Taps of one f32 site at `positions` of `ring`: seq i, step 10 + i, time i."""
    fields = tap_fields() if shard is None else tap_fields(shard=shard)
    header = header_of(wire(encode("tap", fields, [np.zeros(shape, np.float32)])))
    count = len(positions)
    return RingPiece(
        header, ring, positions, first_tid, "h:1", (site, shape), seqs=list(range(count)),
        steps=[10 + i for i in range(count)], devices=[0] * count, times=list(range(count)),
        coords=None if shard is None else [shard["coords"]] * count,
    )  # fmt: skip


def ring_batch(*pieces: RingPiece) -> Frames:
    return wire(encode_ring_batch(list(pieces)))


def test_ring_taps_decode_to_spans_of_neighbouring_taps() -> None:
    """Records as a ring holds them: a header, then the leaves. Taps of one site close
    together in one ring are one span; the rows' offsets count from its start."""
    step = RECORD_HEADER + 8  # one f32[2] tap: 8 bytes
    first = [1000 + RECORD_HEADER + i * step for i in range(3)]
    other = ring_piece([RECORD_HEADER], ring="13-cd.ring", first_tid=103)
    frames = ring_batch(ring_piece(first), other)
    assert len(frames) == 2  # no bytes travel
    message = decode(frames)
    assert message.kind == "ring_taps" and message.runs == ()
    assert message.header["rings"] == ["12-ab.ring", "13-cd.ring"]
    assert len(message.header["statics"]) == 1  # one site, one emitter: one static
    spans = message.spans
    assert [(s.ring, s.start, s.end, len(s)) for s in spans] == [
        ("12-ab.ring", first[0], first[-1] + 8, 3),
        ("13-cd.ring", RECORD_HEADER, RECORD_HEADER + 8, 1),
    ]
    assert [row[8] for row in spans[0].rows] == [0, step, 2 * step]
    # What a subscriber then has, once it has read each span's bytes:
    values = [np.array([i, -i], np.float32) for i in range(3)]
    ring = bytearray(4096)
    for position, value in zip(first, values, strict=True):
        ring[position - 1000 : position - 1000 + 8] = value.tobytes()
    run = spans[0].run(memoryview(bytes(ring[first[0] - 1000 : first[-1] + 8 - 1000])))
    got = [(t.header["tid"], t.header["seq"], t.header["step"], t.header["emitter"])
           for t in (run.message(i) for i in range(len(run)))]  # fmt: skip
    assert got == [(100, 0, 10, "h:1"), (101, 1, 11, "h:1"), (102, 2, 12, "h:1")]
    for got_value, value in zip(run.values(), values, strict=True):
        assert_same_array(got_value, value)


def test_ring_taps_spans_end_at_a_gap_a_size_or_another_site() -> None:
    far = RECORD_HEADER + 8 + SPAN_GAP_BYTES + 8  # past the gap a span reads through
    half = SPAN_BYTES // 2 - 64  # f32 taps of nearly half SPAN_BYTES: two to a span
    frames = ring_batch(
        ring_piece([0, far]),
        ring_piece([far + 64, far + 64 + half + 8, far + 64 + 2 * (half + 8)],
                   shape=(half // 4,), first_tid=102, site="big"),
        ring_piece([far + 64 + 3 * (half + 8) + 64], first_tid=105),
    )  # fmt: skip
    spans = decode(frames).spans
    assert [len(span) for span in spans] == [1, 1, 2, 1, 1]
    assert all(span.end - span.start <= SPAN_BYTES for span in spans)


def test_ring_taps_carry_shard_coordinates_per_tap() -> None:
    shard = shard_field()
    message = decode(ring_batch(ring_piece([64, 184], shape=(2, 3), shard=shard)))
    [span] = message.spans
    [static] = message.header["statics"]
    assert "coords" not in static["shard"]
    assert all(span.static.tap_header(row)["shard"] == shard for row in span.rows)


def test_ring_taps_are_made_by_the_batch_module_only() -> None:
    with pytest.raises(ValueError, match=r"tapd\.protocol\.batch"):
        encode("ring_taps", {"statics": [], "rings": [], "taps": []})


def _row(index: int, field: int, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda h: h["taps"][index].__setitem__(field, value)


BAD_RING_BATCHES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "ring name with a path": (lambda h: h["rings"].__setitem__(0, "../12-ab.ring"), "bad_field"),
    "ring name of another file": (lambda h: h["rings"].__setitem__(0, "passwd"), "bad_field"),
    "ring name not a str": (lambda h: h["rings"].__setitem__(0, 12), "bad_field"),
    "rings not a list": (lambda h: h.__setitem__("rings", "12-ab.ring"), "bad_field"),
    "row names no ring": (_row(0, 7, 1), "bad_field"),
    "negative ring index": (_row(0, 7, -1), "bad_field"),
    "bool ring index": (_row(0, 7, False), "bad_field"),
    "position not an int": (_row(0, 8, "64"), "bad_field"),
    "position nil": (_row(0, 8, None), "bad_field"),
    "negative position": (_row(0, 8, -8), "bad_field"),
    "position past 2**64": (_row(0, 8, 2**64 - 4), "bad_field"),
    "overlapping taps": (_row(1, 8, 64), "bad_field"),
    "taps out of ring order": (_row(1, 8, 0), "bad_field"),
    "row too short": (lambda h: h["taps"][0].pop(), "bad_field"),
    "row not a list": (lambda h: h["taps"].__setitem__(0, {"tid": 1}), "bad_field"),
    "row names no static": (_row(0, 0, 3), "bad_field"),
    "negative seq": (_row(0, 2, -1), "bad_field"),
    "static lacks a field": (lambda h: h["statics"][0].pop("leaves"), "bad_field"),
    "static leaf size": (lambda h: h["statics"][0]["leaves"][0].__setitem__(2, 9), "bad_frames"),
    "coordinates on an unsharded tap": (_row(0, 6, [0]), "bad_shard"),
}


@pytest.mark.parametrize("name", list(BAD_RING_BATCHES))
def test_bad_ring_taps_are_refused(name: str) -> None:
    """Malformed `ring_taps` headers: each refused with ProtocolError and its reason."""
    frames = ring_batch(ring_piece([64, 64 + RECORD_HEADER + 8]))
    decode(frames)  # valid as made
    edit, reason = BAD_RING_BATCHES[name]
    expect_error(with_header(frames, edit), reason)


def test_ring_taps_carry_no_body_frames() -> None:
    frames = ring_batch(ring_piece([64]))
    expect_error([*frames, b"\0" * 8], "bad_frames")


def test_ring_taps_are_bounded_in_taps_rings_and_bytes() -> None:
    taps = ring_batch(ring_piece([0, 64, 128]))
    expect_error(taps, "too_large", Limits(max_batch=2))
    rings = ring_batch(*(ring_piece([0], ring=f"1-{i}a.ring", first_tid=i) for i in range(3)))
    expect_error(rings, "too_large", Limits(max_batch=2))
    # What a subscriber would read for one message: the spans' bytes, gaps and all.
    read = ring_batch(ring_piece([0, 1000]))  # one span of 1008 bytes
    decode(read, Limits(max_message_bytes=1008))
    expect_error(read, "too_large", Limits(max_message_bytes=1007))


@pytest.mark.parametrize("seed", range(20))
def test_ring_taps_garbage_raises_only_protocol_errors(seed: int) -> None:
    """Rows and ring lists of random junk: decoding refuses them with ProtocolError and
    nothing else (one error type, whatever a peer sends)."""
    rng = np.random.default_rng(seed)
    junk: list[Any] = [None, True, -1, 0, 7, 2**64 - 1, 2**63, 1.5, "x", "1-a.ring", b"\x00",
                       [], [0], {}, {"a": 1}]  # fmt: skip
    frames = ring_batch(ring_piece([64, 128]))
    header = header_of(frames)
    for _ in range(50):
        edited = msgpack.unpackb(msgpack.packb(header), raw=False)
        where = rng.integers(3)
        if where == 0:
            edited["rings"][0] = junk[rng.integers(len(junk))]
        elif where == 1:
            row = edited["taps"][rng.integers(2)]
            row[rng.integers(len(row))] = junk[rng.integers(len(junk))]
        else:
            edited["taps"][rng.integers(2)] = junk[rng.integers(len(junk))]
        try:
            decode([frames[0], msgpack.packb(edited, use_bin_type=True)])
        except ProtocolError:
            pass


# ---- sampling and wants (issue 21) ----------------------------------------------------


@pytest.mark.parametrize(
    "every",
    [[["a", 0]], [["a", 2**32 - 1]], [["a", True]], [["b", 2]], [["a", 2], ["a", 3]], [["a"]], 5],
    ids=["zero", "dormant_value", "bool", "not_a_consumer", "twice", "no_n", "not_a_list"],
)
def test_a_subscribers_every_is_checked(every: Any) -> None:
    fields = {"role": "subscriber", "consumers": ["a", "c*"], "window": 1, "every": every}
    expect_error(wire(encode("hello", fields)), "bad_field")


def test_a_subscribers_every_within_bounds_is_kept() -> None:
    fields = {"role": "subscriber", "consumers": ["a", "c*"], "window": 1,
              "every": [["a", 10], ["c*", 2**32 - 2]]}  # fmt: skip
    assert decode(wire(encode("hello", fields))).header["every"] == fields["every"]


@pytest.mark.parametrize(
    "patterns",
    [[["", 1]], [["a", 0]], [["a", -1]], [["x" * 300, 1]], [["a", 1, 2]], "a"],
    ids=["empty_pattern", "zero", "negative", "long_pattern", "three", "not_a_list"],
)
def test_wants_pairs_are_checked(patterns: Any) -> None:
    expect_error(wire(encode("wants", {"patterns": patterns})), "bad_field")


def test_wants_past_the_pattern_bound_are_too_large() -> None:
    patterns = [[f"p{i}", 1] for i in range(DEFAULT_LIMITS.max_patterns + 1)]
    expect_error(wire(encode("wants", {"patterns": patterns})), "too_large")
