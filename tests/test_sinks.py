"""`tapd sink tensorboard` end to end: a real daemon, a JAX emitter, the sink as a process
writing with tensorboardX, and the event files read back with tensorboard's own reader."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import APPS, PROCESS_TIMEOUT, Daemon, wait_until

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
pytest.importorskip("tensorboardX")


def test_tensorboard_sink_writes_scalars_histograms_images(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon()
    logdir = tmp_path / "runs"
    sink = subprocess.Popen(
        [sys.executable, "-m", "tapd", "sink", "tensorboard", "--logdir", str(logdir),
         "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(lambda: daemon.subscriber_count() == 1 or sink.poll() is not None, "the sink")
    assert sink.poll() is None, sink.communicate()
    emitter = subprocess.run([sys.executable, str(APPS / "record_emitter.py"), "image"],
                             env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint},
                             capture_output=True, text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert emitter.returncode == 0, emitter.stderr
    sink.send_signal(signal.SIGTERM)
    out, err = sink.communicate(timeout=PROCESS_TIMEOUT)
    assert sink.returncode == 0, err
    # 5 losses, 3 leaves of params (w, p.x, p.y; None is skipped), vmapped, 2 shards, an image
    assert f"wrote 12 points to {logdir}" in out, out

    events = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={"scalars": 0, "histograms": 0, "images": 0}
    )
    events.Reload()
    tags = events.Tags()
    assert sorted(tags["scalars"]) == ["loss"]
    losses = events.Scalars("loss")
    assert [(e.step, e.value) for e in losses] == [(i, i * 0.5) for i in range(5)]
    assert all(abs(e.wall_time - losses[0].wall_time) < 60 for e in losses)  # meta.time
    assert sorted(tags["histograms"]) == [
        "params/p/x", "params/p/y", "params/w", "shard/shard0", "shard/shard1", "vmapped",
    ]  # fmt: skip
    (w,) = events.Histograms("params/w")
    assert w.step == 3 and w.histogram_value.num == 6
    assert (w.histogram_value.min, w.histogram_value.max, w.histogram_value.sum) == (0, 5, 15)
    (shard,) = events.Histograms("shard/shard1")
    assert shard.step == 1 and shard.histogram_value.sum == 2 + 1 + 3 + 1  # x + 1 on [2, 3]
    (vmapped,) = events.Histograms("vmapped")
    assert vmapped.step == 0 and vmapped.histogram_value.sum == 0 + 1 + 4 + 9  # seq, no step
    (image,) = events.Images("samples")
    assert image.step == 2 and (image.width, image.height) == (5, 4)
    from PIL import Image  # (tensorboard's dependency) the PNG holds the tapped pixels

    pixels = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)))
    np.testing.assert_array_equal(pixels, np.arange(60, dtype=np.uint8).reshape(4, 5, 3))
