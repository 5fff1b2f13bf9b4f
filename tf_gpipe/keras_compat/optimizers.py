"""The hooks for variables and optimizers: where a variable lives, and each optimizer
slot and update on its variable's device.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe.keras_compat.errors import private_attribute

__all__: list[str] = []


# ------------------------------------------------------------------------------ variables
_PLACEMENT = "create each stage's variables on its own device"


def backing_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable (None before it is initialized).

    Uses ``Variable._value``: where a variable lives, and colocating optimizer slots with
    it, needs the backend variable, which Keras does not expose.
    """
    return private_attribute(variable, "_value", _PLACEMENT)


def variable_device(variable: Any) -> str | None:
    """The device a Keras variable's ``tf.Variable`` (or a ``tf.Variable``) lives on; None
    before it exists. Uses ``backing_variable``."""
    raw = backing_variable(variable) if isinstance(variable, keras.Variable) else variable
    return getattr(raw, "device", None) or None


def set_backing_variable(variable: Any, value: Any) -> None:
    """Put ``value`` (a ``tf.Variable``) behind the Keras ``variable``: moves it to a device.
    Uses ``Variable._value``; nothing may have captured the old backing variable yet."""
    backing_variable(variable)  # the attribute must still exist: never create a stray one
    variable._value = value


# ------------------------------------------------------------------------------ optimizers
def colocate_optimizer_slots(optimizer: Any) -> None:
    """Make ``optimizer`` (and a ``LossScaleOptimizer``'s inner one) create each slot on its
    variable's device. Keras asks the distribution strategy to, which the default one
    ignores in a traced step (fit's first): every slot would land on device 0. Wraps
    ``add_variable_from_reference``, through which Keras optimizers make slots."""
    if optimizer is None or getattr(optimizer, "_tf_gpipe_colocated", False):
        return
    colocate_optimizer_slots(getattr(optimizer, "inner_optimizer", None))
    original = private_attribute(
        optimizer, "add_variable_from_reference", "create optimizer slots on each stage's device"
    )

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(variable_device(reference_variable)):
            return original(reference_variable, *args, **kwargs)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer._tf_gpipe_colocated = True


def update_on_variable_device(optimizer: Any) -> None:
    """Make ``optimizer`` run each variable's ``update_step`` (slot arithmetic and
    assigns) under ``tf.device`` of the variable. Keras runs it inside the default
    strategy's ``extended.update``, which sets no device. Wraps the instance's
    ``update_step(gradient, variable, learning_rate)``, which every Keras optimizer
    implements and calls once per variable, and hands it the step count read once per
    device through ``BaseOptimizer._iterations``, which ``iterations`` reads."""
    if optimizer is None or getattr(optimizer, "_tf_gpipe_update_placed", False):
        return
    why = "run each variable's update on its device"
    original = private_attribute(optimizer, "update_step", why)
    steps = private_attribute(optimizer, "_iterations", why)
    # The step count and the learning rate (a variable's, or a schedule's value) read once
    # per device and step graph: each update reading them anew would copy both from their
    # device (device 0), twice per variable. Read before the step's increment, as Keras'
    # own reads are (``apply`` adds 1 after every update). A rate is read per value the
    # optimizer hands over (one, unless it gives weights rates of their own), kept with
    # its read so that its id stays its own.
    read: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def update_step(gradient, variable, learning_rate):
        device = variable_device(variable)
        with tf.device(device):
            if tf.executing_eagerly():
                return original(gradient, variable, learning_rate)
            per_graph = read.setdefault(tf.compat.v1.get_default_graph(), {})
            if device not in per_graph:
                per_graph[device] = tf.identity(steps)
            rate = (device, id(learning_rate))
            if rate not in per_graph:
                per_graph[rate] = (learning_rate, tf.identity(learning_rate))
            count, learning_rate = per_graph[device], per_graph[rate][1]
            # The update reads ``iterations`` (from ``_iterations``): the value read here.
            object.__setattr__(optimizer, "_iterations", count)
            try:
                return original(gradient, variable, learning_rate)
            finally:
                object.__setattr__(optimizer, "_iterations", steps)

    optimizer.update_step = update_step
    optimizer._tf_gpipe_update_placed = True


def skip_default_all_reduce(optimizer: Any) -> None:
    """Skip the default strategy's all-reduce of the gradients when no ``tf.distribute``
    strategy is active: an identity, made as one ``IdentityN`` over every gradient,
    which the placer puts on the default device, routing every stage's gradients there.
    Wraps ``TFOptimizer._all_reduce_sum_gradients``."""
    if optimizer is None or getattr(optimizer, "_tf_gpipe_no_default_all_reduce", False):
        return
    original = private_attribute(
        optimizer, "_all_reduce_sum_gradients", "keep each gradient on its stage's device"
    )

    def all_reduce_sum_gradients(grads_and_vars):
        if tf.distribute.has_strategy():
            return original(grads_and_vars)
        return list(grads_and_vars)

    optimizer._all_reduce_sum_gradients = all_reduce_sum_gradients
    optimizer._tf_gpipe_no_default_all_reduce = True


def optimizer_own_variables(optimizer: Any) -> list:
    """The optimizer's own scalar variables, not per-model-variable slots: its step count
    (``BaseOptimizer._iterations``), the learning rate when it is a variable
    (``BaseOptimizer._learning_rate``), and a
    ``LossScaleOptimizer``'s ``step_counter`` and ``dynamic_scale`` once built."""
    why = "keep the optimizer's own scalars on a stage's device"
    # Not ``iterations``: with gradient accumulation it is computed from ``_iterations``.
    own = []
    for name in ("_iterations", "_learning_rate"):
        v = private_attribute(optimizer, name, why)
        if isinstance(v, keras.Variable):
            own.append(v)
    # A LossScaleOptimizer's (made in build), Nadam's running momentum product.
    for name in ("step_counter", "dynamic_scale", "_u_product"):
        v = getattr(optimizer, name, None)
        if isinstance(v, keras.Variable):
            own.append(v)
    return own


def factored_slots(optimizer: Any) -> list[tuple[Any, Any]]:
    """``[(slot, variable), ...]`` for the slots an optimizer makes without
    ``add_variable_from_reference``, so no hook sees which variable they belong to:
    Adafactor's row and column second moments (``_r``, ``_c``, one per variable, in
    the order of ``_trainable_variables``), made by its ``build``."""
    pairs = []
    for name in ("_r", "_c"):
        slots = getattr(optimizer, name, None)
        if isinstance(slots, list) and slots:
            why = "put Adafactor's factored moments beside their variables"
            variables = private_attribute(optimizer, "_trainable_variables", why)
            pairs += list(zip(slots, variables))
    return pairs
