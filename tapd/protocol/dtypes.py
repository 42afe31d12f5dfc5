"""Array dtypes allowed on the wire, by the names numpy and ml_dtypes give them."""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16, float8_*, int4 with numpy)
import numpy as np

from tapd.errors import ProtocolError

_NAMES = (
    "bool",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
    "complex64", "complex128",
    "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "int4", "uint4",
)  # fmt: skip

_BY_NAME: dict[str, np.dtype[np.generic]] = {}
for _name in _NAMES:
    try:
        _BY_NAME[_name] = np.dtype(_name)
    except TypeError:  # an older ml_dtypes without this type
        pass

SUPPORTED_DTYPES: frozenset[str] = frozenset(_BY_NAME)


def dtype_name(dtype: np.dtype[np.generic]) -> str:
    """The wire name of `dtype`; raises ValueError naming it when it cannot travel."""
    name = dtype.name
    if name not in _BY_NAME:
        raise ValueError(
            f"dtype {dtype!r} cannot be tapped: tapd carries numeric arrays only "
            f"({', '.join(sorted(_BY_NAME))})"
        )
    return name


def dtype_from_name(name: object) -> np.dtype[np.generic]:
    """The little-endian numpy dtype named `name`; ProtocolError if unknown."""
    if not isinstance(name, str) or name not in _BY_NAME:
        raise ProtocolError("bad_dtype", f"unknown dtype {name!r}")
    return _BY_NAME[name]
