"""``SplitSerialWork``: benchmarks/serial_device.py's modelled device with its backward in two halves.

A split schedule (zb-h1) runs each backward as two calls: B, the gradient w.r.t. the
stage input, and later W, the gradient w.r.t. the weights. ``SerialWork``'s backward is
one host call that both gradients read, so each half would pay for all of it. Here the
backward is two host calls on the device's lock: B (``backward_ms - weight_ms``) feeds
only the input gradient and W (``weight_ms``) only the weight gradient, so a B runs the
first, a W the second, and a full backward (gpipe, 1f1b) both: ``backward_ms`` in all,
as ``SerialWork``. Not part of the tf_gpipe package.
"""

from __future__ import annotations

import keras
import serial_device as sd
import tensorflow as tf

__all__ = ["SplitSerialWork"]


@keras.saving.register_keras_serializable(package="tf_gpipe_benchmarks")
class SplitSerialWork(sd.SerialWork):
    """``SerialWork`` whose backward is B (``backward_ms - weight_ms``) then W (``weight_ms``).

    Args:
        device_index, forward_ms, backward_ms, mode: as for ``SerialWork``.
        weight_ms: the weight-gradient share of ``backward_ms``.
    """

    def __init__(self, *args, weight_ms: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0 <= weight_ms <= self.backward_ms:
            raise ValueError(f"weight_ms ({weight_ms}) must lie in [0, backward_ms ({self.backward_ms})]")
        self.weight_ms = float(weight_ms)

    def call(self, x):
        from tf_gpipe import is_recomputing

        d, mode = self.device_index, self.mode
        fwd, b_in, wgt = self.forward_ms, self.backward_ms - self.weight_ms, self.weight_ms
        kind = "R" if is_recomputing() else "F"

        @tf.custom_gradient
        def run(x, s):
            y = sd._host(x, d, fwd, kind, mode) * s

            def grad(dy):
                # Each half reads y, so a re-materialized stage's replay is not pruned from either.
                dx = sd._host(dy, d, b_in, "B", mode, after=y) * s
                ds = tf.reduce_sum(sd._host(dy, d, wgt, "W", mode, after=y) * x)
                return dx, ds

            return y, grad

        return run(x, tf.identity(keras.ops.convert_to_tensor(self.scale)))

    def get_config(self):
        return {**super().get_config(), "weight_ms": self.weight_ms}
