"""Weight regularization (``kernel_regularizer=`` and the like) on each weight's device.

Keras computes a weight's regularization loss when ``model.losses`` is read, in the
reader's device scope: in a pipeline, on the device that computes the loss (or the
default device), which would copy every regularized weight of every stage there, and
compute and hold every one of their gradients there: weight-sized buffers of the whole
model on one device. The training step computes each weight's term on the weight's device
instead, once a step, before the schedule, and its gradient there after the schedule (not
held through the step's peak). Within ``listed`` the model's ``losses`` are those terms, so
the loss (compiled, or a ``compute_loss`` override) adds them as Keras would; the tapes of
the loss see constants, and the step adds ``Regularization.gradient`` to each weight's
gradient on its device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from tf_gpipe import keras_compat

__all__: list[str] = []


class Regularization(NamedTuple):
    """A step's weight regularization, on the weights' devices.

    Attributes:
        losses: what ``model.losses`` lists (the losses layers added, then each regularized
            weight's term), as Keras lists them.
        model: the model whose weights they are.
        optimizer: what scales the gradients as it scales the loss (``scale_loss``: mixed
            precision), or None.
    """

    losses: list[Any]
    model: Any
    optimizer: Any

    def gradient(self, v: Any, after: Any) -> tf.Tensor | None:
        """The gradient of weight ``v``'s loss-scaled term, on its device, computed once
        ``after`` (its other gradients, summed) is: not held through the step's peak."""
        if v.regularizer is None:
            return None
        with tf.device(v.value.device), tf.name_scope("regularization"):
            with tf.control_dependencies([] if after is None else [after]), tf.GradientTape() as tape:
                total = keras_compat.aggregate_additional_loss(self.model, v.regularizer(v))
                scaled = total if self.optimizer is None else self.optimizer.scale_loss(total)
            return tape.gradient(scaled, v)


@contextlib.contextmanager
def listed(model: Any, optimizer: Any) -> Iterator[Regularization]:
    """Compute ``model``'s weight regularization on each weight's device; within the scope
    ``model.losses`` lists it."""
    regularized = [v for v in model.trainable_weights if v.regularizer is not None]
    # The losses layers added come first (Keras' ``Layer.losses``); reading the list also
    # computes the regularization on this device, in ops nothing runs. One in float16 (an
    # activity regularizer under mixed_float16) is cast to floatx: Keras' compute_loss
    # cannot add it to its float32 loss.
    read = list(model.losses)
    added = [_floatx(t) for t in read[: len(read) - len(regularized)]]
    terms = []
    for v in regularized:
        with tf.device(v.value.device), tf.name_scope("regularization"):
            terms.append(v.regularizer(v))
    reg = Regularization(added + terms, model, optimizer)
    with keras_compat.losses_listed(model, reg.losses):
        yield reg


def _floatx(loss: Any) -> Any:
    dtype = tf.as_dtype(keras.backend.floatx())
    return tf.cast(loss, dtype) if loss.dtype.is_floating and loss.dtype != dtype else loss
