"""Test setup: split the host CPU into logical devices before TensorFlow initializes."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

NUM_DEVICES = 4


def _configure() -> None:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_DEVICES)]
    )


_configure()

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def cpu_devices():
    """The logical CPU device names (4 of them) the tests place stages on."""
    return [d.name for d in tf.config.list_logical_devices("CPU")]


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    # free_memory=False skips a full garbage collection (~0.3 s a test).
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(1234)
    yield
