"""What this process's JAX calls its devices, for tap functions in other processes.

host_callback gave a `tap_with_device=True` function the `jax.Device` itself, and
`id_print` printed it as `str(device)`, which differs between JAX versions (`cpu:0` in
jax 0.10, `TFRT_CPU_0` in jax 0.8) and platforms. A subscriber process has no JAX, so a
site that asks for its device carries the names (site meta `device_names`, JSON
{local ordinal: str(device)}), and the subscriber's `TapDevice` prints the one its tap
ran on (client/tapd_client/tap_functions.py).
"""

from __future__ import annotations

import functools
import json

import jax

# A site's static fields are bounded (protocol/schema.py, STATIC_RESERVE): past this,
# the names are left out and a subscriber prints `platform:ordinal`.
_MAX_CHARS = 2048


@functools.cache
def device_names(platform: str) -> dict[str, str]:
    """{"device_names": JSON {local ordinal: str(device)}} for this process's devices of
    `platform`, or {} where there are none or too many to carry."""
    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError:  # no such backend in this process
        return {}
    names = {
        str(device.local_hardware_id): str(device)
        for device in devices
        if device.local_hardware_id is not None
    }
    text = json.dumps(names, separators=(",", ":"))
    return {"device_names": text} if names and len(text) <= _MAX_CHARS else {}
