"""A gradient for ``tf.py_function`` that holds however often its forward op runs.

TensorFlow differentiates a ``tf.py_function`` in a graph by running the Python function
under a tape in the forward, caching that tape under the op's token, and popping it in
the backward. A stage function is traced once and called once per micro-batch, so
every call of a stage kept on a tape (``remat="never"``, the last stage of
``"except_last"``) runs the same op with the same token: each forward overwrites the one
cached tape, the first backward differentiates the last micro-batch's, and the second
finds none (``KeyError: b'pyfunc_11'``). The taped stage call traces its layers under
``replayed()``, which gives ``tf.py_function`` ops this module's gradient instead: it
runs the Python function again, under a tape, on the inputs that micro-batch's forward
got, and differentiates that. It costs one more run of the function per backward (a
re-materialized stage runs it again too) and needs the function to give the same
outputs for the same inputs, as any replay does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tf_gpipe import tf_compat

__all__: list[str] = []

_GRADIENT = "TfGpipeReplayedPyFunction"


@contextlib.contextmanager
def replayed() -> Iterator[None]:
    """Ops made in this scope (in a graph) differentiate ``tf.py_function`` by replaying it."""
    if tf.executing_eagerly():  # eagerly the tape records the call itself
        yield
        return
    with tf.compat.v1.get_default_graph().gradient_override_map({"EagerPyFunc": _GRADIENT}):
        yield


def _trainable(t: tf.Tensor) -> bool:
    return t.dtype.is_floating or t.dtype.is_complex


@tf.RegisterGradient(_GRADIENT)
def _replayed_gradient(op: tf.Operation, *dys: Any) -> list[Any]:
    func = tf_compat.py_function_callable(op)
    inputs, outputs = list(op.inputs), list(op.outputs)
    n = len(inputs)
    dys_full = [tf.zeros_like(o) if dy is None else dy for o, dy in zip(outputs, dys)]

    def gradient(*args: tf.Tensor) -> list[tf.Tensor]:
        xs, gs = list(args[:n]), list(args[n:])
        with tf.GradientTape() as tape:
            tape.watch([x for x in xs if _trainable(x)])
            result = func(*xs)
        flat = list(result) if isinstance(result, (list, tuple)) else [result]
        flat = [tf.convert_to_tensor(r, dtype=o.dtype) for r, o in zip(flat, outputs)]
        pairs = [(r, g) for r, g in zip(flat, gs) if _trainable(r)]
        got = tape.gradient(
            [r for r, _ in pairs],
            xs,
            output_gradients=[g for _, g in pairs],
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        return [tf.zeros_like(x) if g is None else g for x, g in zip(xs, got)]

    grads = tf.py_function(gradient, inputs + dys_full, Tout=[x.dtype for x in inputs])
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    for g, x in zip(grads, inputs):
        g.set_shape(x.shape)
    return [g if _trainable(x) else None for g, x in zip(grads, inputs)]
