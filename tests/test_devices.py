"""Where stages go: device strings, the default placement, and full-float32 comparisons."""

import warnings

import pytest
import tensorflow as tf

from tf_gpipe import devices as devices_lib


class _Fake:
    def __init__(self, name):
        self.name = name


def _pretend(monkeypatch, gpus, cpus=4):
    table = {
        "GPU": [_Fake(f"/device:GPU:{i}") for i in range(gpus)],
        "CPU": [_Fake(f"/device:CPU:{i}") for i in range(cpus)],
    }
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: table.get(kind, []))


def hide_gpus(monkeypatch):
    """No GPU for ``default_devices`` to see, on any machine."""
    listed = tf.config.list_logical_devices
    monkeypatch.setattr(
        tf.config, "list_logical_devices", lambda kind=None: [] if kind == "GPU" else listed(kind)
    )


def test_default_devices_are_the_logical_cpus_without_gpus(cpu_devices, monkeypatch):
    hide_gpus(monkeypatch)
    assert devices_lib.default_devices(3) == cpu_devices[:3]
    assert devices_lib.default_devices(6) == [cpu_devices[k % 4] for k in range(6)]


def test_default_devices_use_every_gpu_and_never_mix_in_cpus(monkeypatch):
    _pretend(monkeypatch, gpus=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as many GPUs as stages: nothing to warn about
        assert devices_lib.default_devices(2) == ["/device:GPU:0", "/device:GPU:1"]


def test_fewer_gpus_than_stages_share_round_robin_with_a_warning(monkeypatch):
    _pretend(monkeypatch, gpus=1)
    with pytest.warns(UserWarning, match=r"4 stages on 1 GPU.*devices=\[\.\.\.\]"):
        assert devices_lib.default_devices(4) == ["/device:GPU:0"] * 4
    _pretend(monkeypatch, gpus=2)
    with pytest.warns(UserWarning, match="3 stages on 2 GPU"):
        assert devices_lib.default_devices(3) == ["/device:GPU:0", "/device:GPU:1", "/device:GPU:0"]


def test_exact_float32_turns_tf32_off_and_restores_it():
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        tf.config.experimental.enable_tensor_float_32_execution(True)
        with devices_lib.exact_float32():
            assert not tf.config.experimental.tensor_float_32_execution_enabled()
        assert tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)


def test_xla_stages_compile_apart_inside_exact_float32(cpu_devices):
    """An XLA program fixes its matmul precision when compiled: inside the block an XLA
    stage gets functions (so programs) of its own; a stage without XLA keeps its own."""
    import keras

    import tf_gpipe
    from tf_gpipe import stage

    pm = tf_gpipe.PipelineModel(
        [keras.layers.Dense(4), keras.layers.Dense(2)], devices=cpu_devices[:2], num_micro_batches=2
    )
    pm.build((None, 3))
    pm.compile(optimizer="sgd", loss="mse", jit_compile=True)
    xla, plain = pm.cells[0], pm.cells[1]
    plain.jit_compile = False
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    try:
        tf.config.experimental.enable_tensor_float_32_execution(True)
        outside = stage.functions(xla), stage.functions(plain)
        with devices_lib.exact_float32():
            inside = stage.functions(xla), stage.functions(plain)
        again = stage.functions(xla), stage.functions(plain)
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)
    assert inside[0] is not outside[0] and again[0] is outside[0]
    assert inside[1] is outside[1]
