"""A Keras layer that models one pipeline device as a serial resource of known cost.

``SerialWork(device_index, forward_ms, backward_ms)`` is the identity times a trainable
scalar; its forward holds a per-device ``threading.Lock`` and sleeps ``forward_ms``, its
gradient holds it and sleeps ``backward_ms``. So a stage costs a known time per action, two
actions of one modelled device never overlap and actions of different devices can (sleeping
holds no CPU and no GIL: call ``configure_threads()`` before TensorFlow initializes so K
sleeping devices never starve the inter-op pool). ``mode="stateless"`` (default) uses
``tf.numpy_function(stateful=False)``; ``mode="py_function"`` uses the stateful
``tf.py_function``, which ``tf.function`` chains across devices (no pipelining: kept to
show that). Why, in detail: benchmarks/schedules/README.md, "Reading it".
Not part of the tf_gpipe package.
"""

from __future__ import annotations

import threading
import time

import keras
import numpy as np
import tensorflow as tf

__all__ = ["SerialWork", "clear_work_log", "configure_threads", "work_log"]

_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
# (device, kind, t_start, t_end) per host-function call while logging is on
# (schedule_efficiency.py --record counts the B and W calls with it).
_LOG: list = []
_LOGGING = {"on": False}
MODES = ("stateless", "py_function")


def configure_threads(inter_op: int = 64, intra_op: int = 2) -> None:
    """Enough inter-op threads that K blocked (sleeping) devices never starve the pool.

    Must run before TensorFlow initializes (before the first op).
    """
    tf.config.threading.set_inter_op_parallelism_threads(inter_op)
    tf.config.threading.set_intra_op_parallelism_threads(intra_op)


def work_log(on: bool | None = None) -> list:
    """The host-side work log; ``work_log(True)`` starts logging, ``work_log(False)`` stops."""
    if on is not None:
        _LOGGING["on"] = on
    return _LOG


def clear_work_log() -> None:
    del _LOG[:]


def _hold(device_index: int, ms: float, kind: str = "") -> None:
    """Hold modelled device ``device_index`` (its lock) for ``ms``."""
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(device_index, threading.Lock())
    with lock:
        t0 = deadline = time.perf_counter()
        deadline += ms / 1e3
        while (left := deadline - time.perf_counter()) > 0:  # a deadline: robust to early wake-ups
            time.sleep(left)
        t1 = time.perf_counter()
    if _LOGGING["on"]:
        _LOG.append((device_index, kind, t0, t1))


def _host(x: tf.Tensor, device_index: int, ms: float, kind: str, mode: str, after=None) -> tf.Tensor:
    """``x`` passed through a host function that holds the device for ``ms``.

    ``after``, if given, is a second (data) input: the work starts once it is
    computed. A data input, not a control dependency: Grappler turns a stateless
    node whose outputs only feed control edges into a NoOp.
    """
    inputs = [x] if after is None else [x, after]

    def work(value, *_):
        _hold(device_index, ms, kind)
        return value

    if mode == "stateless":
        out = tf.numpy_function(
            lambda *v: np.asarray(work(*v)), inputs, Tout=x.dtype, stateful=False, name=f"serial_{kind}"
        )
    else:
        out = tf.py_function(work, inputs, Tout=x.dtype, name=f"serial_{kind}")
    out.set_shape(x.shape)
    return out


@keras.saving.register_keras_serializable(package="tf_gpipe_benchmarks")
class SerialWork(keras.layers.Layer):
    """Identity times a scalar weight; forward and backward cost a fixed time on a locked device.

    Args:
        device_index: which modelled device (lock) this layer's work holds.
        forward_ms: sleep per forward call (per action: independent of the batch).
        backward_ms: sleep per gradient call.
        mode: ``"stateless"`` or ``"py_function"`` (see the module docstring).
    """

    def __init__(self, device_index: int, forward_ms: float, backward_ms: float, mode="stateless", **kwargs):
        super().__init__(**kwargs)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.device_index, self.forward_ms, self.backward_ms = (
            int(device_index),
            float(forward_ms),
            float(backward_ms),
        )
        self.mode = mode

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        d, fwd, bwd, mode = self.device_index, self.forward_ms, self.backward_ms, self.mode

        @tf.custom_gradient
        def run(x, w):
            y = _host(x, d, fwd, "F", mode) * w  # a replayed (re-materialized) forward costs fwd again

            def grad(dy):
                # The backward consumes the forward's output: without it the gradient would
                # not need the forward at all, and the replayed forward of a re-materialized
                # stage (remat="always") would be pruned instead of costing forward_ms.
                dy = _host(dy, d, bwd, "B", mode, after=y)
                return dy * w, tf.reduce_sum(dy * x)

            return y, grad

        # A tensor, not the variable: custom_gradient would otherwise ask for `variables=` in eager mode.
        return run(x, tf.identity(keras.ops.convert_to_tensor(self.scale)))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        names = ("device_index", "forward_ms", "backward_ms", "mode")
        return dict(super().get_config(), **{name: getattr(self, name) for name in names})
