"""Array dtypes allowed on the wire, by the names numpy and ml_dtypes give them.

ml_dtypes (bfloat16, float8_*, int4) is imported at the first use of one of its types,
not with this module: its import costs ~0.5 s of CPU, which every daemon start,
subscriber and `tapd` command paid for types most of them never see. What checks a
header needs of a dtype is its item size, which a table here gives.
"""

from __future__ import annotations

import threading

import numpy as np

from tapd.errors import ProtocolError

_NUMPY_NAMES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
)  # fmt: skip
# ml_dtypes' types and their item sizes (tests/test_protocol.py checks them against it).
_ML_DTYPES_ITEMSIZE = {
    "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e4m3b11fnuz": 1,
    "int4": 1, "uint4": 1,
}  # fmt: skip

_BY_NAME: dict[str, np.dtype[np.generic]] = {name: np.dtype(name) for name in _NUMPY_NAMES}
_ITEMSIZE: dict[str, int] = {
    **{name: dtype.itemsize for name, dtype in _BY_NAME.items()},
    **_ML_DTYPES_ITEMSIZE,
}
_ml_dtypes_lock = threading.Lock()

SUPPORTED_DTYPES: frozenset[str] = frozenset(_ITEMSIZE)


def dtype_name(dtype: np.dtype[np.generic]) -> str:
    """The wire name of `dtype`; raises ValueError naming it when it cannot travel."""
    name = dtype.name
    if name not in _ITEMSIZE:
        raise ValueError(
            f"dtype {dtype!r} cannot be tapped: tapd carries numeric arrays only "
            f"({', '.join(sorted(_ITEMSIZE))})"
        )
    return name


def dtype_itemsize(name: object) -> int:
    """The item size of the dtype named `name` (no import); ProtocolError if unknown."""
    if not isinstance(name, str) or name not in _ITEMSIZE:
        raise ProtocolError("bad_dtype", f"unknown dtype {name!r}")
    return _ITEMSIZE[name]


def dtype_from_name(name: object) -> np.dtype[np.generic]:
    """The little-endian numpy dtype named `name`; ProtocolError if unknown."""
    dtype = _BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is not None:
        return dtype
    dtype_itemsize(name)  # (raises for a name that is no dtype of ours)
    assert isinstance(name, str)
    with _ml_dtypes_lock:
        if name not in _BY_NAME:
            import ml_dtypes

            _BY_NAME[name] = np.dtype(getattr(ml_dtypes, name))
    return _BY_NAME[name]
