"""Weight regularization (``kernel_regularizer=`` and the like) on each weight's device.

Keras computes a weight's regularization loss when ``model.losses`` is read, in the
reader's device scope: in a pipeline, on the device that computes the loss (or the
default device), which would copy every regularized weight of every stage there, and
compute and hold every one of their gradients there: weight-sized buffers of the whole
model on one device. The training step computes each weight's term and its gradient on
the weight's device instead, once a step, before the schedule. Within ``listed`` the model's
``losses`` are those values, so the loss (compiled, or a ``compute_loss`` override) adds them
as Keras would; the tapes of the loss see constants, and the step adds ``grads`` to the
weights' gradients on their devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import tensorflow as tf

from tf_gpipe import keras_compat

__all__: list[str] = []


class Regularization(NamedTuple):
    """A step's weight regularization, computed on the weights' devices.

    Attributes:
        losses: what ``model.losses`` lists (the losses layers added, then each regularized
            weight's term), as Keras lists them.
        grads: ``id(weight)`` -> the gradient of its loss-scaled term, on its device.
    """

    losses: list[Any]
    grads: dict[int, tf.Tensor]


@contextlib.contextmanager
def listed(model: Any, optimizer: Any, gradients: bool = True) -> Iterator[Regularization]:
    """Compute ``model``'s weight regularization on each weight's device; within the scope
    ``model.losses`` lists it. ``optimizer`` scales the gradients as it scales the loss
    (``scale_loss``: mixed precision); None leaves them unscaled. ``gradients=False``
    (``evaluate``) computes the terms only."""
    regularized = [v for v in model.trainable_weights if v.regularizer is not None]
    if not regularized:
        yield Regularization(list(model.losses), {})
        return
    # The losses layers added come first (Keras' ``Layer.losses``); reading the list also
    # computes the regularization on this device, in ops nothing runs.
    added = list(model.losses)[: -len(regularized)]
    terms, grads = [], {}
    for v in regularized:
        with tf.device(v.value.device), tf.name_scope("regularization"):
            with tf.GradientTape() as tape:
                term = v.regularizer(v)
                total = keras_compat.aggregate_additional_loss(model, term)
                scaled = total if optimizer is None else optimizer.scale_loss(total)
            if gradients:
                grads[id(v)] = tape.gradient(scaled, v)
        terms.append(term)
    reg = Regularization(added + terms, grads)
    with keras_compat.losses_listed(model, reg.losses):
        yield reg
