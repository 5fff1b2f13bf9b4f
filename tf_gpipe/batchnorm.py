"""Deferred BatchNormalization statistics: one moving-statistics update per mini-batch.

GPipe normalizes each micro-batch with its own statistics while training, but
moves the running statistics once per mini-batch, from the statistics of the
whole mini-batch, so that after a step they equal what the unsplit model
computes. Keras' BatchNormalization would instead move them once per
micro-batch (momentum applied M times, each from a smaller sample).

Each BatchNormalization layer of a stage (nested ones included) is observed
(``keras_compat.observe_batch_norm_moments``) for the duration of a training
forward: the micro-batch mean and variance it computes are recorded with their
element count, and its own moving-statistics writes are dropped. After the last micro-batch the
recorded moments are pooled (sum of counts, means, and second moments) and
applied in one update with the layer's momentum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat

__all__ = ["DeferredStats", "batch_norm_layers"]


def batch_norm_layers(layers: Sequence[keras.layers.Layer]) -> list[keras.layers.BatchNormalization]:
    """Every BatchNormalization among ``layers`` and their sublayers (renorm excluded)."""
    found: list[keras.layers.BatchNormalization] = []
    seen: set[int] = set()
    for layer in layers:
        for sub in keras_compat.nested_layers(layer):
            if isinstance(sub, keras.layers.BatchNormalization) and not sub.renorm and id(sub) not in seen:
                seen.add(id(sub))
                found.append(sub)
    return found


def _count(inputs: tf.Tensor, mask: Any, axes: Sequence[int]) -> tf.Tensor:
    """Elements pooled per channel, as BatchNormalization's own moments count them."""
    if mask is None:
        shape = tf.shape(inputs)
        return tf.cast(tf.reduce_prod(tf.gather(shape, list(axes))), inputs.dtype)
    weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
    return tf.reduce_sum(weights, axis=list(axes))


class DeferredStats:
    """Pools BatchNormalization moments over the micro-batches of one mini-batch."""

    def __init__(self) -> None:
        self._sums: dict[int, list[tf.Tensor]] = {}
        self._layers: dict[int, keras.layers.BatchNormalization] = {}

    def skipped_variables(self, layers: Sequence[keras.layers.BatchNormalization]) -> set[int]:
        """ids of the moving statistics whose per-micro-batch writes must be dropped."""
        return {id(v) for bn in layers for v in (bn.moving_mean, bn.moving_variance)}

    @contextlib.contextmanager
    def capture(
        self, layers: Sequence[keras.layers.BatchNormalization], nonempty: Any = None
    ) -> Iterator[None]:
        """Record the moments every layer in ``layers`` computes inside the block.

        ``nonempty`` (a boolean tensor, or None for True) is False for a padded
        micro-batch: its stand-in example must not count.
        """
        with contextlib.ExitStack() as stack:
            for bn in layers:

                def record(inputs, mask, mean, variance, _bn=bn):
                    count = _count(inputs, mask, keras_compat.batch_norm_reduction_axes(_bn))
                    count = tf.reshape(count, tf.shape(mean)) if mask is not None else count
                    if nonempty is not None:
                        count = tf.where(nonempty, count, tf.zeros_like(count))
                    self._add(_bn, count, mean, variance)

                stack.enter_context(keras_compat.observe_batch_norm_moments(bn, record))
            yield

    def _add(self, bn, count, mean, variance) -> None:
        # Sums of n, n*mean and n*(variance + mean^2); an empty micro-batch (NaN moments,
        # zero count) adds nothing. Statistics, not activations: no gradient flows back
        # through them. A taped stage returns them beside its outputs, and its gated
        # gradient (``tf_gpipe.gated``) covers the outputs only, so without the stop
        # TensorFlow ran a second backward of every layer below a BatchNormalization
        # through them (with zero gradients, but every op run).
        count, mean, variance = (tf.stop_gradient(t) for t in (count, mean, variance))
        n_mean = tf.where(count > 0, count * mean, tf.zeros_like(mean))
        n_square = tf.where(count > 0, count * (variance + tf.square(mean)), tf.zeros_like(mean))
        self.add_sums(bn, [count, n_mean, n_square])

    def add_sums(self, bn: keras.layers.BatchNormalization, sums: Sequence[tf.Tensor]) -> None:
        """Pool ``[n, n*mean, n*(variance + mean^2)]`` of some examples into ``bn``'s totals."""
        key = id(bn)
        self._layers[key] = bn
        if key in self._sums:
            self._sums[key] = [a + b for a, b in zip(self._sums[key], sums)]
        else:
            self._sums[key] = list(sums)

    def sums(self) -> list[tuple]:
        """``(layer, [n, n*mean, n*(variance + mean^2)])`` per layer recorded so far.

        A stage function returns these for its micro-batch, so that the moments
        leave the function as outputs and are pooled outside it.
        """
        return [(self._layers[key], list(sums)) for key, sums in self._sums.items()]

    def apply(self) -> None:
        """Move each layer's statistics once, from the pooled moments."""
        for key, (count, n_mean, n_square) in self._sums.items():
            bn = self._layers[key]
            mean = tf.math.divide_no_nan(n_mean, count)
            variance = tf.maximum(tf.math.divide_no_nan(n_square, count) - tf.square(mean), 0.0)
            momentum = bn.momentum
            moving_mean = tf.cast(bn.moving_mean, mean.dtype)
            moving_variance = tf.cast(bn.moving_variance, mean.dtype)
            new_mean = moving_mean * momentum + mean * (1.0 - momentum)
            new_variance = moving_variance * momentum + variance * (1.0 - momentum)
            nonempty = tf.reduce_all(count > 0)  # a batch with no example leaves them alone
            bn.moving_mean.assign(tf.where(nonempty, new_mean, moving_mean))
            bn.moving_variance.assign(tf.where(nonempty, new_variance, moving_variance))
        self._sums.clear()
