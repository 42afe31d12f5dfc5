"""`CallbackException` reads as host_callback's did (issue 27, item 1): after "Last one
was:" the last failure's exception as `traceback.format_exception` formats it, so that
JAX's own host_callback test regex matches, then tapd's list of every failure. How it
gets there from real processes (subscribers, tap functions run in the JAX process, a
forwarder between) is tested in test_end_to_end.py, test_local_functions.py,
test_forward.py and test_host_callback_compat.py; here the text itself."""

from __future__ import annotations

import re
import traceback

import pytest
import zmq

import tapd
from tapd.errors import failure_text
from tapd.protocol import decode
from tapd_client.daemon_link import DaemonLink

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

# host_callback_test.py, test_tap_eval_exception (jax commit 2228115cf4).
JAX_REGEX = re.compile(
    "There were exceptions during callback processing. Last one was:.*"
    "ValueError: Some user message",
    re.DOTALL,
)


def tap_err(*args: object) -> None:
    raise ValueError("Some user message")


def raised_by(function: object, *args: object) -> BaseException:
    with pytest.raises(Exception) as info:
        function(*args)  # type: ignore[operator]
    return info.value


def test_the_last_failure_is_the_formatted_exception_then_every_failure_is_listed() -> None:
    first = raised_by(lambda: {}["missing"])
    last = raised_by(tap_err)
    reported = [f"a#0: {failure_text('handle', first)}", f"b#7: {failure_text('tap_err', last)}"]
    error = tapd.CallbackException(reported)
    text = str(error)
    assert JAX_REGEX.search(text), text
    # What host_callback put after "Last one was: ": traceback.format_exc() of the last.
    formatted = "".join(traceback.format_exception(last)).rstrip()
    assert text.startswith(
        f"There were exceptions during callback processing. Last one was: {formatted}\n\n"
    )
    assert text.endswith(
        "2 tap function call(s) raised:\n"
        "  a#0: handle raised KeyError('missing')\n"
        "  b#7: tap_err raised ValueError('Some user message')"
    )
    assert error.errors == [
        "a#0: handle raised KeyError('missing')",
        "b#7: tap_err raised ValueError('Some user message')",
    ]


def test_a_failure_reported_without_a_traceback_is_shown_as_it_came() -> None:
    text = str(tapd.CallbackException(["loss#3: the subscriber could not decode this tap: x"]))
    assert text.startswith(
        "There were exceptions during callback processing. Last one was: "
        "loss#3: the subscriber could not decode this tap: x\n"
    )


def deep(levels: int) -> None:
    if levels:
        deeper(levels - 1)  # (two functions in turn: Python folds a frame repeated)
    raise ValueError("Some user message")


def deeper(levels: int) -> None:
    deep(levels)


def test_a_long_traceback_loses_its_first_lines_never_its_last() -> None:
    exc = raised_by(deep, 200)
    whole = "".join(traceback.format_exception(exc))
    assert len(whole) > 4000
    text = failure_text("deep", exc, limit=4000)
    assert len(text) <= 4000
    summary, _, formatted = text.partition("\n")
    assert summary == "deep raised ValueError('Some user message')"
    assert formatted.startswith("[... the traceback's first lines were cut ...]\n")
    kept = formatted.partition("\n")[2]
    assert whole.endswith(kept) and kept.startswith("  File ")  # whole lines, the last ones
    assert JAX_REGEX.search(str(tapd.CallbackException([f"d#0: {text}"])))


def test_an_exception_whose_repr_spans_lines_keeps_the_summary_on_one_line() -> None:
    class Odd(Exception):
        def __repr__(self) -> str:
            return "Odd(\n'two lines')"

    text = failure_text("handle", raised_by(lambda: (_ for _ in ()).throw(Odd("m"))))
    summary, _, formatted = text.partition("\n")
    assert summary == "handle raised Odd( 'two lines')"
    assert formatted.rstrip().endswith("Odd: m")


def test_one_ack_carries_only_the_newest_traceback_however_many_taps_fail() -> None:
    """400 failures with tracebacks of nearly 4000 characters would be an ack of over
    1.2 MB, past what a daemon decodes (1 MiB): each keeps its first line, the newest its
    traceback too."""
    context = zmq.Context()
    daemon = context.socket(zmq.ROUTER)
    subscriber = context.socket(zmq.DEALER)
    try:
        daemon.bind("inproc://acks")
        subscriber.connect("inproc://acks")
        link = DaemonLink("inproc://acks", subscriber)
        texts = [failure_text(f"deep{n}", raised_by(deep, 200)) for n in range(400)]
        # (how long a traceback is depends on the Python and on the checkout's path)
        assert sum(len(text) for text in texts) > 1_200_000
        for tid, text in enumerate(texts):
            link.fail(tid, text)
        link.last_tid = 399
        link.ack()
        assert daemon.poll(10_000), "no ack"
        ack = decode(daemon.recv_multipart()[1:])  # (after the subscriber's identity)
        errors = [entry["error"] for entry in ack.header["errors"]]
        assert errors == [text.partition("\n")[0] for text in texts[:-1]] + [texts[-1]]
        assert JAX_REGEX.search(
            str(tapd.CallbackException([f"d#{n}: {e}" for n, e in enumerate(errors)]))
        )
    finally:
        subscriber.close(linger=0)
        daemon.close(linger=0)
        context.term()
