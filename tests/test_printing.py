"""id_print's output, as host_callback's `_print_tap_func` printed it (no JAX here): the
keywords sorted on one line, then the value, laid out as jax's pretty printer did."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tapd.printing import print_tap, render
from tapd_client.meta import TapMeta
from tapd_client.tap_functions import tap_function_keywords

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)


def printed(arg: object, transforms: object = (), **kwargs: object) -> str:
    stream = io.StringIO()
    print_tap(arg, transforms, output_stream=stream, **kwargs)
    return stream.getvalue()


def test_keywords_first_sorted_then_the_value() -> None:
    assert printed(np.array(10.0, np.float32), what="a * 2") == "what: a * 2\n10.\n"
    assert printed(np.arange(3), where="s_1", nr=2) == "nr: 2 where: s_1\n[0 1 2]\n"
    assert printed(np.array(1)) == "1\n"  # no keywords, no header line


def test_transforms_and_device_are_printed_among_the_keywords() -> None:
    batch = (("batch", {"batch_dims": (0,)}),)
    assert printed(np.arange(2.0), batch, what="x") == (
        "transforms: [('batch', {'batch_dims': (0,)})] what: x\n[0. 1.]\n"
    )
    assert printed(np.array(2.0), (("transpose", {}),), what="ct") == (
        "transforms: ['transpose'] what: ct\n2.\n"
    )
    assert printed(np.array(3), device="cpu:1", what="z") == "device: cpu:1 what: z\n3\n"


def test_containers_as_host_callback_laid_them_out() -> None:
    assert render((np.array(3.0), np.arange(4.0, 6.0))) == "( 3. [4. 5.] )"
    assert render({"b": np.array(2), "a": [np.array(1)]}) == "{ a=[ 1 ] b=2 }"
    value = {"a": np.arange(12.0).reshape(3, 4),
             "b": (np.arange(30), [np.array(1), np.array(2.5)])}  # fmt: skip
    assert render(value) == (
        "{ a=[[ 0.  1.  2.  3.]\n [ 4.  5.  6.  7.]\n [ 8.  9. 10. 11.]]\n"
        "  b=( [ 0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19 20 21 22 23\n"
        " 24 25 26 27 28 29]\n    [ 1 2.5 ] ) }"
    )


def test_threshold_goes_to_array2string() -> None:
    assert printed(np.arange(10), threshold=5) == "[0 1 2 ... 7 8 9]\n"


def test_batch_dims_arrive_as_tuples() -> None:
    header = {"consumer": "c", "seq": 0, "step": None, "device": None, "process": 0,
              "host": "h", "pid": 1, "time": 0, "meta": {},
              "transforms": [["batch", {"batch_dims": [0, None]}], ["transpose", {}]]}  # fmt: skip
    meta = TapMeta.from_header(header)
    assert meta.transforms == (("batch", {"batch_dims": (0, None)}), ("transpose", {}))


def test_module_mode_names_the_device_as_the_emitters_jax_did() -> None:
    """`tapd subscribe tapd.printing` has no JAX: a `tap_with_device` site carries what
    the emitter's JAX called its devices (jax 0.8: `TFRT_CPU_1`), and the printed device
    is that; a site from a tapd that did not carry them prints `platform:ordinal`."""
    header = {"consumer": "tapd.printing:print_tap", "seq": 0, "step": None, "device": 1,
              "process": 0, "host": "h", "pid": 1, "time": 0, "transforms": [],
              "meta": {"tap_with_device": True, "device_platform": "cpu", "what": "x",
                       "device_names": '{"0":"TFRT_CPU_0","1":"TFRT_CPU_1"}'}}  # fmt: skip
    keywords = tap_function_keywords(TapMeta.from_header(header))
    assert printed(np.array(3), **keywords) == "device: TFRT_CPU_1 what: x\n3\n"
    older = {**header, "meta": {k: v for k, v in header["meta"].items() if k != "device_names"}}
    keywords = tap_function_keywords(TapMeta.from_header(older))
    assert printed(np.array(3), **keywords) == "device: cpu:1 what: x\n3\n"
