"""Shared builders for the equivalence tests: the same layers, split and unsplit."""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

import tf_gpipe

ROOT = Path(__file__).resolve().parents[1]

# On a GPU two programs that compute the same function (a loop and the built-out step; a
# pipeline's per-stage XLA programs and keras.Sequential's one) fuse and order their float32
# sums differently. Those last-bit differences are what a few Adam steps grow (m / sqrt(v)
# where a gradient is near zero): comparisons of trained weights there allow 1e-4, not 1e-5.
ON_GPU = bool(tf.config.list_logical_devices("GPU"))
TRAINED_TOL = 1e-4 if ON_GPU else 1e-5


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a test's child process: this checkout first on its PYTHONPATH,
    whatever the parent's PYTHONPATH holds after it (TensorFlow may live there), ``extra``."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def memory_probe(script: str, *args: str) -> str:
    """The standard output of ``script`` run in a fresh Python, as a probe of the CPU
    allocator needs it: logical CPUs set up before TensorFlow starts, the BFC allocator
    (TensorFlow's default CPU allocator keeps statistics only where oneDNN is on, which
    depends on the host's CPU), and any GPU hidden."""
    env = child_env(TF_CPP_MIN_LOG_LEVEL="3", TF_CPU_ALLOCATOR_USE_BFC="true", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def mlp_layers(seed=0, width=12, depth=5, out=3, dtype=None, extra=()):
    """Fresh layers with deterministic initial weights."""
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(width, activation="tanh", dtype=dtype) for _ in range(depth)]
    layers.extend(extra)
    layers.append(keras.layers.Dense(out, dtype=dtype))
    return layers


def pair(make_layers, input_shape, input_dtype=None, **pipeline_kwargs):
    """A built keras.Sequential and a PipelineModel of identical layers and weights."""
    if input_dtype is None:
        seq = keras.Sequential(make_layers())
        seq.build(input_shape)
    else:  # an explicit Input keeps keras.Sequential from casting inputs to float32
        seq = keras.Sequential([keras.Input(input_shape[1:], dtype=input_dtype)] + make_layers())
    pm = tf_gpipe.PipelineModel(make_layers(), **pipeline_kwargs)
    pm.build(input_shape)
    pm.set_weights(seq.get_weights())
    return seq, pm


def data(n, d=8, classes=3, seed=0, dtype="float32"):
    rng = np.random.RandomState(seed)
    return rng.randn(n, d).astype(dtype), rng.randint(0, classes, n)


def record_slots(optimizer):
    """``[(variable, slot), ...]``, filled as ``optimizer`` makes each slot through the public
    ``add_variable_from_reference`` (call before ``compile``)."""
    made = []
    original = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        slot = original(reference_variable, *args, **kwargs)
        made.append((reference_variable, slot))
        return slot

    optimizer.add_variable_from_reference = add_variable_from_reference
    return made


def assert_all_close(a_list, b_list, rtol=1e-5, atol=1e-5):
    a_list, b_list = list(a_list), list(b_list)
    assert len(a_list) == len(b_list)
    for a, b in zip(a_list, b_list):
        a = tf.convert_to_tensor(a) if not isinstance(a, np.ndarray) else a
        b = tf.convert_to_tensor(b) if not isinstance(b, np.ndarray) else b
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def loss_and_grads(model, x, y, training=True):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        out = model(x, training=training)
        loss = loss_fn(y, out)
    return out, loss, tape.gradient(loss, model.trainable_variables)


def partition_graphs(fn):
    """The partition graphs (one per device and function) that ran while ``fn()`` ran.

    The eager context keeps run metadata across calls: what earlier calls (an earlier
    test in this process) left is exported and dropped first.
    """
    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.enable_graph_collection()  # partition graphs are collected when a function is instantiated
    try:
        ctx.export_run_metadata()
        fn()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_graph_collection()
        ctx.disable_run_metadata()
    return [g for f in metadata.function_graphs for g in f.partition_graphs]


def fit_both(seq, pm, x, y, batch_size=10):
    """Compile both with SGD and sparse cross-entropy, fit one epoch in order, and check that
    the losses and weights match."""
    for m in (seq, pm):
        m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    a = seq.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0).history["loss"]
    b = pm.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(b, a, rtol=1e-5)
    assert_all_close(pm.get_weights(), seq.get_weights(), rtol=1e-5, atol=1e-6)


def same_device(actual: str, expected: str) -> bool:
    """Whether two device names, spelled in any way (short or with job and task), name the
    same kind and index."""
    a, e = tf.DeviceSpec.from_string(actual), tf.DeviceSpec.from_string(expected)
    return (a.device_type, a.device_index) == (e.device_type, e.device_index)


class TiedHead(keras.layers.Layer):
    """Logits from the token embedding's own matrix (weight tying, as GPT-2's head)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, x):
        return keras.ops.matmul(x, keras.ops.transpose(self.embedding.embeddings))
