"""The sinks end to end: a real daemon, a JAX emitter, the sink as a process (`tapd sink
TOOL`, or `tapd subscribe --sink SPEC`) writing with the tool's own library, and what it
wrote read back with the tool's own reader: tensorboard's event reader, MlflowClient,
and wandb's offline transaction log parsed into wandb's own protobuf records."""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import APPS, PROCESS_TIMEOUT, Daemon, wait_until


def start_sink(argv: list[str], daemons: list[Daemon], **popen: Any) -> subprocess.Popen[str]:
    """`python -m tapd ARGV --endpoint ...`, once every daemon counts it as a subscriber."""
    endpoints = [arg for daemon in daemons for arg in ("--endpoint", daemon.endpoint)]
    sink = subprocess.Popen([sys.executable, "-m", "tapd", *argv, *endpoints],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)  # fmt: skip
    wait_until(lambda: all(d.subscriber_count() == 1 for d in daemons) or sink.poll() is not None,
               "the sink")  # fmt: skip
    assert sink.poll() is None, sink.communicate()
    return sink


def stop_sink(sink: subprocess.Popen[str]) -> str:
    sink.send_signal(signal.SIGTERM)
    out, err = sink.communicate(timeout=PROCESS_TIMEOUT)
    assert sink.returncode == 0, err
    return out


def emit(daemon: Daemon, *args: str) -> None:
    """Run tests/apps/record_emitter.py (5 losses, a pytree, vmap, 2 pmap shards, [image])."""
    emitter = subprocess.run([sys.executable, str(APPS / "record_emitter.py"), *args],
                             env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint},
                             capture_output=True, text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert emitter.returncode == 0, emitter.stderr


def read_events(logdir: Path) -> Any:
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard reads back the event files",
    )
    events = event_accumulator.EventAccumulator(
        str(logdir), size_guidance={"scalars": 0, "histograms": 0, "images": 0}
    )
    events.Reload()
    return events


def png_pixels(data: bytes) -> np.ndarray:
    from PIL import Image  # (tensorboard's, mlflow's and wandb's image library)

    return np.asarray(Image.open(io.BytesIO(data)))


IMAGE = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)  # what record_emitter taps


def test_tensorboard_sink_writes_scalars_histograms_images(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    pytest.importorskip("tensorboardX", reason="the TensorBoard sink writes with tensorboardX")
    daemon = start_daemon()
    logdir = tmp_path / "runs"
    sink = start_sink(["sink", "tensorboard", "--logdir", str(logdir)], [daemon])
    emit(daemon, "image")
    out = stop_sink(sink)
    # 5 losses, 3 leaves of params (w, p.x, p.y; None is skipped), vmapped, 2 shards, an image
    assert f"wrote 12 points to {logdir}" in out, out

    events = read_events(logdir)
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
    np.testing.assert_array_equal(png_pixels(image.encoded_image_string), IMAGE)


# ---- MLflow ----------------------------------------------------------------------------


def test_mlflow_sink_logs_metrics_array_stats_images_to_the_default_file_store(
    start_daemon: Callable[..., Daemon], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlflow = pytest.importorskip("mlflow", reason="the MLflow sink logs with mlflow")
    daemon = start_daemon()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    # No --tracking-uri: the sink makes ./mlruns in its working directory. --assemble puts
    # the 2 pmap shards of "shard" back together before they are written.
    sink = start_sink(["sink", "mlflow", "--experiment", "exp1", "--run-name", "r1",
                       "--assemble", "loss", "shard", "samples"], [daemon],
                      cwd=tmp_path, env=env)  # fmt: skip
    emit(daemon, "image")
    out = stop_sink(sink)
    uri = (tmp_path / "mlruns").as_uri()
    assert "wrote 7 points to MLflow run " in out and out.rstrip().endswith(f" at {uri}"), out

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 reads file stores only so
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("exp1")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert sorted(run.data.metrics) == [
        "loss", "shard/max", "shard/mean", "shard/min", "shard/norm",
    ]  # fmt: skip
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in losses) == [(i, i * 0.5) for i in range(5)]
    assert all(abs(m.timestamp - losses[0].timestamp) < 60_000 for m in losses)  # meta.time
    assert run.info.start_time - 60_000 < losses[0].timestamp < run.info.end_time
    # The assembled global value, x + 1 over the 2x2 arange: [[1, 2], [3, 4]], at step 1.
    stats = {key: client.get_metric_history(run.info.run_id, f"shard/{key}") for key in
             ("mean", "min", "max", "norm")}  # fmt: skip
    assert {key: [(m.step, m.value) for m in got] for key, got in stats.items()} == {
        "mean": [(1, 2.5)], "min": [(1, 1.0)], "max": [(1, 4.0)], "norm": [(1, 30**0.5)],
    }  # fmt: skip
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    (png,) = [p for p in images if p.startswith("images/samples+step+2+") and p.endswith(".png")]
    local = client.download_artifacts(run.info.run_id, png, str(tmp_path))
    np.testing.assert_array_equal(png_pixels(Path(local).read_bytes()), IMAGE)


def test_mlflow_sink_names_a_bad_tracking_uri(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the MLflow sink logs with mlflow")
    result = subprocess.run([sys.executable, "-m", "tapd", "sink", "mlflow", "--tracking-uri",
                             "nosuchscheme://x"], capture_output=True, text=True,
                            timeout=PROCESS_TIMEOUT, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 1
    assert "cannot start an MLflow run at 'nosuchscheme://x'" in result.stderr, result.stderr


@pytest.mark.fast
@pytest.mark.parametrize(
    ("tool", "library"), [("tensorboard", "tensorboardX"), ("mlflow", "mlflow"), ("wandb", "wandb")]
)
def test_a_sink_without_its_library_names_the_extra_to_install(
    tool: str, library: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tapd_client.sinks import make_sink

    monkeypatch.setitem(sys.modules, library, None)  # what `import` does when it is missing
    with pytest.raises(ImportError, match=rf"pip install 'tapd\[{tool}\]'"):
        make_sink(tool, str(tmp_path) if tool == "tensorboard" else None)


# ---- Weights & Biases --------------------------------------------------------------------


def wandb_records(run_file: Path) -> Iterator[Any]:
    """The records of an offline run's `.wandb` file, as wandb's own protobuf `Record`s.
    wandb 0.31 no longer ships a Python reader of this file (its `DataStore` is gone), so
    this undoes its framing, LevelDB's log format: a 7-byte file header, then 32 KiB
    blocks of chunks, each `crc32 (4) | length (2) | type (1) | data`, a record being one
    FULL chunk or FIRST, MIDDLE..., LAST; the checksum (zlib's crc32 of type and data)
    is checked, so a misread cannot pass as a record."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, record = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding of a block's tail
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"bad checksum at byte {pos}"
        pos += 7 + length
        record += chunk
        if kind in (1, 4):  # FULL, LAST
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def history_rows(run_file: Path) -> list[dict[str, Any]]:
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})  # fmt: skip
    return rows


def test_wandb_sink_logs_scalars_histograms_images_offline_with_tapd_step_axis(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    pytest.importorskip("wandb", reason="the W&B sink logs with wandb")
    daemon = start_daemon()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true"}  # fmt: skip
    sink = start_sink(["sink", "wandb", "--project", "proj", "--run-name", "r1"], [daemon],
                      env=env)  # fmt: skip
    emit(daemon, "image")
    out = stop_sink(sink)
    assert "wrote 12 points to W&B run " in out, out
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "exit" in kinds  # finish() ran
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("proj", "r1")
    axes = {r.metric.name: r.metric.step_metric for r in records
            if r.WhichOneof("record_type") == "metric" and r.metric.name}  # fmt: skip
    tags = ["loss", "params/p/x", "params/p/y", "params/w", "samples", "shard/shard0",
            "shard/shard1", "vmapped"]  # fmt: skip
    assert axes == {"tapd/step": "", **{tag: "tapd/step" for tag in tags}}

    rows = history_rows(run_file)
    keys = {key for row in rows for key in row if not key.startswith("_")}  # (wandb's own)
    media = {key.removesuffix("/_type") for key in keys if key.endswith("/_type")}
    assert sorted(media) == [tag for tag in tags if tag != "loss"]
    assert {key for key in keys if not key.startswith(tuple(media))} == {"loss", "tapd/step"}
    losses = [(row["tapd/step"], row["loss"]) for row in rows if "loss" in row]
    assert losses == [(i, i * 0.5) for i in range(5)]
    (w,) = [row for row in rows if "params/w/_type" in row]
    assert w["tapd/step"] == 3 and w["params/w/_type"] == "histogram"
    assert sum(w["params/w/values"]) == 6  # counts of the 6 values
    assert (w["params/w/bins"][0], w["params/w/bins"][-1]) == (0, 5)
    for index in (0, 1):  # x + 1 on [2 * index, 2 * index + 1], at step 1
        (shard,) = [row for row in rows if f"shard/shard{index}/_type" in row]
        bins = shard[f"shard/shard{index}/bins"]
        assert shard["tapd/step"] == 1 and (bins[0], bins[-1]) == (2 * index + 1, 2 * index + 2)
    (vmapped,) = [row for row in rows if "vmapped/_type" in row]
    assert vmapped["tapd/step"] == 0  # the tap's seq: it has no step
    (image,) = [row for row in rows if "samples/_type" in row]
    assert image["tapd/step"] == 2 and image["samples/_type"] == "image-file"
    assert (image["samples/width"], image["samples/height"]) == (5, 4)
    png = run_file.parent / "files" / image["samples/path"]
    np.testing.assert_array_equal(png_pixels(png.read_bytes()), IMAGE)


# ---- tapd subscribe --sink: a 2-process job, process tags and assembled shards ---------


def test_subscribe_runs_sinks_with_process_tags_and_assembly_on_a_two_process_job(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    pytest.importorskip("tensorboardX", reason="the TensorBoard sink writes with tensorboardX")
    from test_multihost import STEPS, free_port, run_job

    hosts = [start_daemon(name="host0.sock"), start_daemon(name="host1.sock")]
    tagged, assembled = tmp_path / "tagged", tmp_path / "assembled"
    sink = start_sink(["subscribe", "--sink", f"tensorboard:{tagged},process_in_tag",
                       "--sink", f"tensorboard:{assembled},assemble"], hosts)  # fmt: skip
    run_job([h.endpoint for h in hosts], f"127.0.0.1:{free_port()}", [[], []])
    out = stop_sink(sink)
    # Each of 8 devices taps {"shard", "total"} per step: 16 tagged points a step, and
    # 2 global ones once the step's 8 shards are together.
    assert f"wrote {16 * STEPS} points to {tagged}" in out, out
    assert f"wrote {2 * STEPS} points to {assembled}" in out, out

    events = read_events(tagged)
    expected = sorted(f"p{p}/multihost/{leaf}/shard{4 * p + d}" for p in (0, 1)
                      for d in range(4) for leaf in ("shard", "total"))  # fmt: skip
    assert sorted(events.Tags()["scalars"]) == expected
    for p in (0, 1):
        for d in range(4):
            points = events.Scalars(f"p{p}/multihost/shard/shard{4 * p + d}")
            assert [(e.step, e.value) for e in points] == [(s, 10.0 * p + d) for s in range(STEPS)]

    events = read_events(assembled)
    assert sorted(events.Tags()["histograms"]) == ["multihost/shard", "multihost/total"]
    shards = events.Histograms("multihost/shard")
    assert [e.step for e in shards] == list(range(STEPS))
    for e in shards:  # the global [0, 1, 2, 3, 10, 11, 12, 13]
        h = e.histogram_value
        assert (h.num, h.min, h.max, h.sum) == (8, 0, 13, 52)
    total = sum(range(4)) + sum(range(10, 14))
    for e in events.Histograms("multihost/total"):
        assert (e.histogram_value.num, e.histogram_value.sum) == (8, 8 * total)


def test_subscribe_sink_specs_are_checked_before_anything_runs() -> None:
    bad = {
        "nosuch:x": "no sink 'nosuch'",
        "tensorboard": "the tensorboard sink needs a logdir",
        "tensorboard:runs,assemble=maybe": "assemble='maybe' is not true or false",
        "mlflow,colour=red": "the mlflow sink has no option 'colour'",
        "wandb,run_name": "run_name needs a value",
    }
    for spec, message in bad.items():
        argv = [sys.executable, "-m", "tapd", "subscribe", "--sink", spec]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=PROCESS_TIMEOUT)
        assert result.returncode == 2 and message in result.stderr, (spec, result.stderr)
    result = subprocess.run([sys.executable, "-m", "tapd", "subscribe"], capture_output=True,
                            text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert result.returncode == 2 and "give a tap function MODULE, or a --sink" in result.stderr
