"""Test setup: split the host CPU into logical devices before TensorFlow initializes.

On a machine with GPUs the suite compares like with like: TF32 is off for the whole
test run (float32 matmuls on a GPU then round as on a CPU), and every test runs with
``/CPU:0`` as its default device, so unsplit references run on the same kind of device
as the stages the tests place on logical CPUs. Tests that leave ``devices=None`` put
their stages wherever ``tf_gpipe.devices.default_devices`` says (GPUs when visible).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The memory probes read the CPU allocator's peak (tf.config.experimental.get_memory_info),
# which only the BFC allocator keeps; child processes inherit the setting.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import tensorflow as tf

NUM_DEVICES = 4


def _configure() -> None:
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_DEVICES)]
    )
    tf.config.experimental.enable_tensor_float_32_execution(False)


_configure()

import gc  # noqa: E402

import keras  # noqa: E402
import pytest  # noqa: E402
from tensorflow.python.framework import ops as _tf_ops  # noqa: E402

# The modules' objects (~400k after importing TensorFlow and Keras) live as long as the
# test run: keep them out of every full garbage collection (clear_session runs one).
gc.freeze()
# Tracing makes millions of short-lived objects: with CPython's default thresholds (700,
# 10, 10) a worker ran ~6,000 collections over a third of the suite, 5% of its time; 20,000
# allocations a young collection run a twentieth as many, the cycles still collected.
gc.set_threshold(20_000, 20, 20)


@pytest.fixture(scope="session")
def cpu_devices():
    """The logical CPU device names (4 of them) the tests place stages on."""
    return [d.name for d in tf.config.list_logical_devices("CPU")]


@pytest.fixture
def fresh_tracing_counts(monkeypatch):
    """TensorFlow's counts of recent traces, fresh: it warns of frequent retracing at most
    twice per traced code in a process, so an earlier test's warnings would leave nothing
    to see in this one."""
    from tensorflow.python.eager.polymorphic_function import polymorphic_function as pf

    monkeypatch.setattr(pf, "_frequent_tracing_detector_manager", pf._FrequentTracingDetectorManager())


@pytest.fixture(autouse=True)
def _forget_custom_gradients():
    # Every trace through tf.custom_gradient (tf_gpipe's re-materialization, Keras' ops)
    # registers its gradient function in TensorFlow's global gradient registry, never
    # removed: it holds the traced graph, so every test's graphs would stay alive, and
    # each garbage collection would walk them all (the suite ran ~1.5x slower by its end).
    # A test's graphs are not differentiated after it ends; its registrations go with it.
    registry = getattr(getattr(_tf_ops, "_gradient_registry", None), "_registry", None)
    before = set(registry) if isinstance(registry, dict) else None
    yield
    if before is not None:
        for name in [n for n in registry if n not in before and n.startswith("CustomGradient-")]:
            del registry[name]


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    # free_memory=False skips a full garbage collection (~0.3 s a test).
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(1234)
    with tf.device("/device:CPU:0"):
        yield


@pytest.fixture
def mixed_float16():
    """Keras' mixed_float16 policy for one test."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture
def stage_traces(monkeypatch):
    """``stage_traces(model)``: per stage, how often its forward and backward bodies were
    traced, the ``(inputs, weights)`` of each backward's ``stage.Part`` traced
    (``"halves"``), and how often its replay was traced to be split (``"replays"``: ZB-H1's
    B of a re-materialized stage, ``tf_gpipe.stash.replay``). Counted by wrapping the stage
    functions' Python bodies: the library keeps no counters of its own."""
    import functools
    import inspect

    from tf_gpipe import stage

    counts: dict = {}

    def entry(fns):
        return counts.setdefault(id(fns.cell), {"forward": 0, "backward": 0, "halves": set(), "replays": 0})

    run_forward = stage.StageFunctions._run_forward
    backward_body = stage.StageFunctions._backward_body
    signature = inspect.signature(backward_body)

    @functools.wraps(run_forward)
    def counted_forward(self, *args, **kwargs):
        entry(self)["forward"] += 1
        return run_forward(self, *args, **kwargs)

    @functools.wraps(backward_body)
    def counted_backward(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        found = entry(self)
        found["backward"] += 1
        part = bound.arguments["part"]
        found["halves"].add((bool(part.inputs), bool(part.weights)))
        return backward_body(self, *args, **kwargs)

    replay_body = stage.StageFunctions._replay_split_body

    @functools.wraps(replay_body)
    def counted_replay(self, *args, **kwargs):
        entry(self)["replays"] += 1
        return replay_body(self, *args, **kwargs)

    monkeypatch.setattr(stage.StageFunctions, "_replay_split_body", counted_replay)
    monkeypatch.setattr(stage.StageFunctions, "_run_forward", counted_forward)
    monkeypatch.setattr(stage.StageFunctions, "_backward_body", counted_backward)

    def of(model):
        return [
            {k: set(v) if isinstance(v, set) else v for k, v in entry(stage.functions(c)).items()}
            for c in model.cells
        ]

    return of
