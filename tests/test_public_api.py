"""The public surface: what is exported, what importing costs, trace-time refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import tapd
import tapd_client


@pytest.fixture(autouse=True, scope="module")
def in_process_emitter(tmp_path_factory: pytest.TempPathFactory) -> None:
    """These tests only trace taps; keep this process's emitter away from any daemon."""
    from tapd.emitter import lifecycle

    if lifecycle._sender is None and lifecycle._settings is None:
        tapd.configure(endpoint=f"ipc://{tmp_path_factory.mktemp('t')}/none.sock",
                       backend="portable", exit_timeout=0)  # fmt: skip


@pytest.mark.fast
def test_exported_members() -> None:
    assert sorted(tapd.__all__) == sorted([
        "BarrierTimeout", "CallbackException", "CallbackFlavor", "ConfigError",
        "ProtocolError", "TapDefinitionError", "TapFunctionException", "TapdError",
        "__version__", "after_callbacks", "backend", "barrier_wait", "configure", "debug",
        "deserialize", "id_print", "id_tap", "install_debug", "install_host_callback", "stats",
        "tap",
    ])  # fmt: skip
    assert sorted(tapd.debug.__all__) == [
        "callback", "install", "jax_callback", "jax_io_callback", "jax_print", "log", "print",
    ]  # fmt: skip
    assert sorted(tapd_client.__all__) == [
        "Assembler",
        "BatchHandler",
        "Handler",
        "ShardInfo",
        "Subscriber",
        "TapBatch",
        "TapMeta",
    ]
    for module in (tapd, tapd_client):
        for name in module.__all__:
            assert hasattr(module, name), name


def test_importing_tapd_and_the_subscriber_library_does_not_import_jax() -> None:
    code = (
        "import sys, tapd, tapd_client, tapd.cli.main, tapd.daemon.server, "
        "tapd_client.tap_functions, tapd.printing\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)\n"
        "print('clean')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


def test_sinks_export_their_registry_and_import_no_tool_until_one_is_made() -> None:
    code = (
        "import json, sys, tapd_client.sinks as sinks, tapd_client.sinks.tensorboard, "
        "tapd_client.sinks.mlflow, tapd_client.sinks.wandb\n"
        "heavy = {'jax', 'tensorboardX', 'mlflow', 'wandb'}\n"
        "print(json.dumps([sorted(sinks.__all__), sorted(sinks.SINKS),\n"
        "                  sorted(m for m in sys.modules if m.split('.')[0] in heavy)]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    exported, tools, imported = json.loads(result.stdout)
    assert exported == ["SINKS", "Sink", "SinkKind", "Tee", "make_sink", "parse_spec"]
    assert tools == ["mlflow", "tensorboard", "wandb"]
    assert imported == []


def module_level_tap(arg: object, transforms: object) -> None:
    """An importable tap function (never run here)."""


@pytest.mark.fast
def test_id_tap_names_importable_functions() -> None:
    from tapd.emitter.host_callback import consumer_name

    assert consumer_name(module_level_tap) == f"{__name__}:module_level_tap"


@pytest.mark.fast
def test_callback_exception_is_host_callbacks_name_and_tap_function_exception_its_alias() -> None:
    assert tapd.CallbackException is tapd.TapFunctionException
    assert issubclass(tapd.CallbackException, tapd.TapdError)


@pytest.mark.fast
def test_callback_exception_begins_with_host_callbacks_words_then_lists_every_call() -> None:
    # host_callback's own test matched these words (CallbackException's message).
    error = tapd.CallbackException(["loss#3: ValueError('a')", "loss#4: KeyError('b')"])
    assert str(error).startswith(
        "There were exceptions during callback processing. Last one was: loss#4: KeyError('b')\n"
    )
    assert "2 tap function call(s) raised:\n  loss#3: ValueError('a')\n  loss#4:" in str(error)


@pytest.mark.fast
def test_id_tap_keywords_are_refused_pointing_to_functools_partial() -> None:
    with pytest.raises(TypeError, match=r"functools\.partial\(tap_func, \*\*kwargs\)"):
        tapd.id_tap(module_level_tap, 1.0, y=2)


@pytest.mark.fast
def test_host_callback_names_tapd_does_not_offer_say_what_to_use() -> None:
    with pytest.raises(AttributeError, match="io_callback"):
        tapd.call  # noqa: B018
    with pytest.raises(AttributeError, match="no outfeed"):
        tapd.stop_outfeed_receiver  # noqa: B018
    assert not hasattr(tapd, "no_such_name")


@pytest.mark.fast
def test_device_index_must_name_a_local_device() -> None:
    with pytest.raises(tapd.TapDefinitionError, match="device_index=99"):
        jax.make_jaxpr(lambda x: tapd.id_tap(module_level_tap, x, device_index=99))(1.0)


@pytest.mark.fast
def test_unsupported_leaf_is_refused_at_trace_time_naming_the_tap() -> None:
    with pytest.raises(tapd.TapDefinitionError, match="tap 'weird', leaf 1"):
        jax.make_jaxpr(lambda x: tapd.tap((x, "text"), "weird"))(1.0)


@pytest.mark.fast
def test_static_metadata_must_be_plain_values() -> None:
    with pytest.raises(tapd.TapDefinitionError, match="metadata scale="):
        jax.make_jaxpr(lambda x: tapd.tap(x, "m", scale=jnp.ones(2)))(1.0)


@pytest.mark.fast
def test_tap_returns_its_argument_as_the_taps_output() -> None:
    def doubled(x: jax.Array) -> jax.Array:
        tapped = tapd.tap(x, "identity")
        assert tapped.aval == x.aval  # the tap's output: later uses come after the tap
        return tapped * 2

    jaxpr = jax.make_jaxpr(doubled)(1.0)
    assert "tapd_tap" in str(jaxpr)


@pytest.mark.fast
def test_spec_outside_a_per_device_region_is_refused_at_trace_time() -> None:
    from jax.sharding import PartitionSpec as P

    with pytest.raises(tapd.TapDefinitionError, match="inside shard_map or pmap only"):
        jax.jit(lambda x: tapd.tap(x, "rows", spec=P("data")))(jnp.ones(3))


@pytest.mark.fast
def test_spec_must_name_the_axes_the_tap_runs_under_and_fit_the_leaf() -> None:
    from jax.sharding import PartitionSpec as P

    with pytest.raises(tapd.TapDefinitionError, match="names mesh axis 'model'"):
        jax.pmap(lambda x: tapd.tap(x, "rows", spec=P("model")), axis_name="data")(jnp.ones((1, 2)))
    with pytest.raises(tapd.TapDefinitionError, match="2 entries but the tapped leaf has only 1"):
        jax.pmap(lambda x: tapd.tap(x, "rows", spec=P("i", None)), axis_name="i")(jnp.ones((1, 2)))
