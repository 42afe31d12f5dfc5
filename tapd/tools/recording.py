"""The on-disk format of `tapd record` (docs/RECORDING.md): numpy's own files, nothing
of tapd's needed to read them.

A recording is a directory of chunks, each a pair written once and never appended to:
`NNNNNN.npz` (the chunk's arrays: per group of taps of one site that arrived together,
one array per leaf with the taps stacked on axis 0, named `g<group>_<leaf>`) and
`NNNNNN.jsonl` (one JSON object per tap: its meta, tree spec, leaves, the names of its
group's arrays in the npz and its `row` in them). Each file is written under a temporary
name and renamed into place, the npz first, so a chunk is either complete or absent: an
interrupt, even a kill -9, can lose the chunk being filled but never leave a file that
does not open. `recording.json` says what the directory is. Rotation removes whole
chunks, oldest first (index first).

Dtypes numpy has no name for (bfloat16, float8_*, int4...) are stored as unsigned
integers of the same size; the index's `leaves` entry keeps the real dtype name, and
`read_recording` (or `.view(ml_dtypes.<name>)`) turns the bytes back.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tapd.protocol.dtypes import dtype_from_name

FORMAT = "tapd-recording"
FORMAT_VERSION = 2  # 2: taps stacked per group, `row` in the index; 1: an array per leaf
INFO_FILE = "recording.json"

# The fields of a tap header that a recording keeps, as the protocol spells them
# (docs/PROTOCOL.md, `tap`); `time` stays in integer nanoseconds.
HEADER_FIELDS = (
    "consumer",
    "seq",
    "step",
    "device",
    "process",
    "host",
    "pid",
    "emitter",
    "time",
    "transforms",
    "meta",
    "tree",
    "leaves",
    "shard",
)
_NUMPY_NATIVE = frozenset(
    (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)


# Taps of one site written together: their headers, and each leaf stacked on axis 0.
Group = tuple[Sequence[Mapping[str, Any]], Sequence[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class RecordedTap:
    """One tap read back: `header` as the protocol's `tap` header (meta, tree, leaves),
    `arrays` its leaves, in order, with their real dtypes."""

    header: dict[str, Any]
    arrays: list[np.ndarray]

    def value(self) -> Any:
        from tapd.protocol import unflatten

        return unflatten(self.header["tree"], self.arrays)


class ChunkWriter:
    """Writes a recording's chunks into `directory`, numbering on from what is there."""

    def __init__(self, directory: Path, *, consumers: Sequence[str] = ()) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".*.tmp"):  # a write that a kill -9 cut short
            stale.unlink(missing_ok=True)
        existing = chunk_numbers(directory)
        self.next_number = existing[-1] + 1 if existing else 0
        info = directory / INFO_FILE
        if not info.exists():
            _write_atomically(
                info,
                json.dumps(
                    {
                        "format": FORMAT,
                        "version": FORMAT_VERSION,
                        "consumers": list(consumers),
                        "started": time.time(),
                    },
                    indent=2,
                ).encode()
                + b"\n",
            )

    def write(self, groups: Sequence[Group]) -> int:
        """Write one chunk of `groups` (headers of taps of one site, and their leaves
        stacked on axis 0); return its size in bytes."""
        number = self.next_number
        self.next_number += 1
        arrays: dict[str, np.ndarray] = {}
        lines = []
        for g, (headers, leaves) in enumerate(groups):
            names = []
            for j, array in enumerate(leaves):
                name = f"g{g}_{j}"
                if array.dtype.name not in _NUMPY_NATIVE:  # (numpy would save it as void)
                    array = array.view(f"u{array.dtype.itemsize}")
                arrays[name] = array
                names.append(name)
            for row, header in enumerate(headers):
                entry = {field: header.get(field) for field in HEADER_FIELDS}
                entry["arrays"] = names
                entry["row"] = row
                lines.append(json.dumps(entry, separators=(",", ":"), default=_jsonable))
        npz = self.directory / f"{number:06d}.npz"
        temporary = npz.with_name(f".{npz.name}.tmp")
        _save_npz(temporary, arrays)
        os.replace(temporary, npz)
        index = npz.with_suffix(".jsonl")
        _write_atomically(index, ("\n".join(lines) + "\n").encode())
        return npz.stat().st_size + index.stat().st_size

    def remove_oldest(self) -> int:
        """Remove the oldest chunk (its index first); return the bytes freed."""
        numbers = chunk_numbers(self.directory)
        if not numbers:
            return 0
        freed = 0
        for suffix in (".jsonl", ".npz"):
            path = self.directory / f"{numbers[0]:06d}{suffix}"
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                pass
        return freed

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("[0-9]*.*"))


def chunk_numbers(directory: Path) -> list[int]:
    """The complete chunks in `directory` (both files there), oldest first."""
    numbers = []
    for index in directory.glob("[0-9]*.jsonl"):
        if index.stem.isdigit() and index.with_suffix(".npz").exists():
            numbers.append(int(index.stem))
    return sorted(numbers)


def read_recording(directory: str | os.PathLike[str]) -> Iterator[RecordedTap]:
    """Every tap of a recording, in the order it was recorded."""
    path = Path(directory)
    info = path / INFO_FILE
    if not info.exists():
        raise FileNotFoundError(f"{path} is not a tapd recording (no {INFO_FILE})")
    fields = json.loads(info.read_text())
    if fields.get("format") != FORMAT or fields.get("version") not in (1, FORMAT_VERSION):
        raise ValueError(
            f"{path}: not a {FORMAT} of version 1 to {FORMAT_VERSION}: {fields!r:.200}"
        )
    for number in chunk_numbers(path):
        index = path / f"{number:06d}.jsonl"
        with np.load(index.with_suffix(".npz")) as npz:
            arrays: dict[str, np.ndarray] = {}  # (each member read once, not once per row)
            for line in index.read_text().splitlines():
                header = json.loads(line)
                row = header.pop("row", None)  # (None: version 1, an array per leaf)
                leaves = []
                for name, (dtype, _, _) in zip(header.pop("arrays"), header["leaves"], strict=True):
                    if name not in arrays:
                        arrays[name] = npz[name]
                    array = arrays[name] if row is None else arrays[name][row, ...]
                    if array.dtype.name != dtype:
                        array = array.view(dtype_from_name(dtype))
                    leaves.append(array)
                yield RecordedTap(header, leaves)


def _save_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """What `np.savez` writes (a zip, stored, of one .npy per array), without its copy of
    each array into a bytes object: the array's own buffer goes to the file."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in arrays.items():
            array = np.ascontiguousarray(array) if array.ndim else array.copy()
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(
                    member, np.lib.format.header_data_from_array_1_0(array)
                )
                if array.nbytes:
                    member.write(array.reshape(-1).view(np.uint8).data)


def _write_atomically(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    raise TypeError(f"cannot record {type(value).__name__} {value!r:.60}")
