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
recorded moments are pooled and applied in one update with the layer's momentum.

The moments are pooled as (count, mean, sum of squared deviations from the mean), merged
with Chan's parallel formula: the pooled variance is never a difference of two large
numbers, as E[x^2] - mean^2 is in float32 when the mean is large against the spread
(inputs of 1000 + 0.1 * noise: a variance of 0.01 is lost below float32's resolution of 1e6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat

__all__: list[str] = []


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


def moments(count: tf.Tensor, mean: tf.Tensor, variance: tf.Tensor) -> list[tf.Tensor]:
    """``[n, mean, sum of squared deviations]`` of ``count`` examples of this ``mean`` and
    (biased) ``variance``; those of no example (NaN moments) are all zero."""
    some = count > 0
    return [
        count,
        tf.where(some, mean, tf.zeros_like(mean)),
        tf.where(some, count * variance, tf.zeros_like(variance)),
    ]


def merge(a: Sequence[tf.Tensor], b: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Pool two lists of ``moments`` triples (layer after layer), Chan's parallel formula.

    The deviation of the two means, not the raw second moments, carries what their
    difference adds to the spread: exact to float32's resolution of the spread itself.
    """
    out: list[tf.Tensor] = []
    for i in range(0, len(a), 3):
        (n_a, mean_a, sq_a), (n_b, mean_b, sq_b) = a[i : i + 3], b[i : i + 3]
        n = n_a + n_b
        delta = mean_b - mean_a
        out += [
            n,
            mean_a + delta * tf.math.divide_no_nan(n_b, n),
            sq_a + sq_b + tf.square(delta) * tf.math.divide_no_nan(n_a * n_b, n),
        ]
    return out


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
        # Statistics, not activations: no gradient flows back through them. A taped stage
        # returns them beside its outputs, and its gated gradient (``tf_gpipe.gated``)
        # covers the outputs only, so without the stop TensorFlow ran a second backward of
        # every layer below a BatchNormalization through them (with zero gradients, but
        # every op run).
        count, mean, variance = (tf.stop_gradient(t) for t in (count, mean, variance))
        count = tf.cast(count, mean.dtype)
        self.add_sums(bn, moments(count, mean, variance))

    def add_sums(self, bn: keras.layers.BatchNormalization, sums: Sequence[tf.Tensor]) -> None:
        """Pool ``[n, mean, sum of squared deviations]`` of some examples into ``bn``'s totals."""
        key = id(bn)
        self._layers[key] = bn
        if key in self._sums:
            self._sums[key] = merge(self._sums[key], sums)
        else:
            self._sums[key] = list(sums)

    def sums(self) -> list[tuple]:
        """``(layer, [n, mean, sum of squared deviations])`` per layer recorded so far.

        A stage function returns these for its micro-batch, so that the moments
        leave the function as outputs and are pooled outside it (``merge``).
        """
        return [(self._layers[key], list(sums)) for key, sums in self._sums.items()]

    def apply(self) -> None:
        """Move each layer's statistics once, from the pooled moments."""
        for key, (count, mean, squares) in self._sums.items():
            bn = self._layers[key]
            variance = tf.math.divide_no_nan(squares, count)
            momentum = bn.momentum
            moving_mean = tf.cast(bn.moving_mean, mean.dtype)
            moving_variance = tf.cast(bn.moving_variance, mean.dtype)
            new_mean = moving_mean * momentum + mean * (1.0 - momentum)
            new_variance = moving_variance * momentum + variance * (1.0 - momentum)
            nonempty = tf.reduce_all(count > 0)  # a batch with no example leaves them alone
            bn.moving_mean.assign(tf.where(nonempty, new_mean, moving_mean))
            bn.moving_variance.assign(tf.where(nonempty, new_variance, moving_variance))
        self._sums.clear()
