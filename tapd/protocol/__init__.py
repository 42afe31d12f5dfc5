"""tapd's wire protocol (docs/PROTOCOL.md): pure encode/decode, no sockets."""

from tapd.protocol.dtypes import dtype_from_name, dtype_name
from tapd.protocol.tree import TreeSpec, flatten, unflatten
from tapd.protocol.wire import MAGIC, VERSION, Limits, Message, decode, encode

__all__ = [
    "MAGIC",
    "VERSION",
    "Limits",
    "Message",
    "TreeSpec",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "encode",
    "flatten",
    "unflatten",
]
