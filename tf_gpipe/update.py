"""The optimizer update: each variable's update on the variable's own device.

Keras applies gradients through the default ``tf.distribute`` strategy, whose ops
carry no device (an ``IdentityN`` all-reduce over every gradient, and an
``extended.update`` that does not colocate with the variable). TensorFlow's placer
puts such ops on the process' default device, so every stage's gradients and
optimizer slots would travel to device 0 and back each step, and device 0 would
hold every stage's update temporaries: the device a model was split away from.

Here the update keeps to the stages' devices:

- each variable's ``update_step`` (slot arithmetic and assigns) runs under
  ``tf.device(variable.device)``;
- every other op the optimizer makes inside the training step (loss-scale
  unscaling and finite checks, clipping, weight decay, moving averages,
  gradient accumulation, learning-rate schedules) is placed beside its inputs,
  the largest input first, so per-variable work stays on that variable's device
  and only scalars (norms, ``isfinite`` flags, the learning rate) cross;
- without an active ``tf.distribute`` strategy there is nothing to all-reduce, and
  the default strategy's all-reduce (an identity) is skipped;
- the optimizer's own scalars (``iterations``, the learning rate, a loss-scale
  optimizer's scale) live on the first stage's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat, ordering, tf_compat
from tf_gpipe.cell import move_variables

__all__: list[str] = []

_BRANCHES = frozenset({"If", "StatelessIf", "Case", "StatelessCase"})


def place_optimizer(optimizer: Any, home: str) -> None:
    """Set ``optimizer`` (and a ``LossScaleOptimizer``'s inner one) up to update each
    variable on its device; its own scalar variables move to ``home``."""
    if optimizer is None:
        return
    keras_compat.colocate_optimizer_slots(optimizer)
    keras_compat.update_on_variable_device(optimizer)
    keras_compat.skip_default_all_reduce(optimizer)
    move_variables(keras_compat.optimizer_own_variables(optimizer), home)
    for slot, variable in keras_compat.factored_slots(optimizer):
        move_variables([slot], keras_compat.variable_device(variable) or "")
    place_optimizer(getattr(optimizer, "inner_optimizer", None), home)


def build_optimizer(optimizer: Any, variables: Sequence[Any], home: str) -> None:
    """Make ``optimizer``'s slots for ``variables`` now, before a step is traced, each beside
    its variable, and its own scalars on ``home``."""
    if not optimizer.built:
        optimizer.build(list(variables))
        place_optimizer(optimizer, home)  # what build made


def apply(optimizer: Any, grads: Sequence[Any], variables: Sequence[Any]) -> None:
    """``optimizer.apply_gradients(zip(grads, variables))``, each op beside its inputs."""
    if not tf.inside_function():  # eagerly, each update_step is already on its device
        optimizer.apply_gradients(zip(grads, variables))
        return
    # Ops of the update that do not read the gradients (weight decay, moving
    # averages) would otherwise be free to write a variable while a backward still
    # reads it: the update starts once every gradient is done.
    done = [t for g in grads if g is not None for t in tf.nest.flatten(g, expand_composites=True)]
    _build(optimizer, variables)
    own = keras_compat.optimizer_own_variables(optimizer)
    home = (keras_compat.variable_device(own[0]) if own else None) or ""
    with tf.control_dependencies(_gate(done, home)), tf.compat.v1.device(_BesideInputs(home)):
        optimizer.apply_gradients(zip(grads, variables))


def _build(optimizer: Any, variables: Sequence[Any]) -> None:
    """Make the optimizer's variables as ``apply_gradients`` would, but outside the update's
    control dependencies. A slot made inside them has an initializer that waits for a
    backward, which TensorFlow cannot lift out of the step: fit's first call would then run
    the step inside a ``cond`` that initializes the slots, and its second call would optimize
    the step's graph again (1.4 s for a 4-stage Transformer)."""
    if optimizer.built:
        return
    with tf.control_dependencies(None), keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(list(variables))
    optimizer.built = True


def _gate(tensors: Sequence[tf.Tensor], home: str) -> list[Any]:
    """One op that has run once every tensor of ``tensors`` is computed (none if there are
    none): per device, the op that makes them all, or a NoOp after them; of several
    devices, a NoOp on ``home`` after those.

    Every op of the update takes a control edge from it. One edge per gradient on each of
    the update's ~1,000 ops was ~70,000 edges for grappler to optimize (a first step ~1 s
    slower); one per device, ~4,000 at K=4, made a first step with the loops ~2% slower."""
    by_device: dict[str, dict[str, tf.Operation]] = {}
    for t in tensors:
        by_device.setdefault(t.device, {})[t.op.name] = t.op
    gates: list[Any] = []
    for device, ops in by_device.items():
        if len(ops) == 1:
            gates.extend(ops.values())
            continue
        with tf.device(device), tf.control_dependencies(list(ops.values())):
            gates.append(tf.no_op(name="gradients_done"))
    if len(gates) <= 1:
        return gates
    with tf.device(home), tf.control_dependencies(gates):
        return [tf.no_op(name="all_gradients_done")]


class _BesideInputs:
    """A graph device function: an op made without a device goes where its largest input is."""

    def __init__(self, home: str) -> None:
        self._devices: dict[int, str] = {}
        self._last = home  # where the optimizer's own scalars live

    def __call__(self, op: tf.Operation) -> str:
        if op.type in _BRANCHES and not op.device:
            # Its lowered switches and merges go where the predicate is (a stage's
            # device), not to the default device; the branches' ops are placed here one by one.
            return self.device_of(op.inputs[0])
        # Its body is a function: no device here, each op in the body is placed on its own
        # (a device on the caller would become the default of its body).
        if op.type in ordering.FUNCTION_OPS:
            return op.device
        if not op.device and op.inputs:
            found = self._choose(op)
        elif not op.device:
            # A constant: ops make theirs just before using them (``x * 2.0``,
            # ``ones_like``), so it goes where the op made last went.
            found = self._last
        else:
            found = op.device
        self._last = found or self._last
        return found

    def _choose(self, op: tf.Operation) -> str:
        best, best_size = "", -1.0
        for t in op.inputs:
            device = self.device_of(t)
            if not device:
                continue
            if t.dtype == tf.resource:  # reads and writes must sit beside the variable
                return device
            size = _size(t)
            if size > best_size:
                best, best_size = device, size
        return best

    def device_of(self, t: tf.Tensor) -> str:
        """The device ``t`` was placed on, following captures and unplaced ops."""
        if t.op.device:
            return t.op.device
        key = id(t)
        if key not in self._devices:
            self._devices[key] = ""  # cycles (loops' back edges) resolve to unknown
            source = tf_compat.captured_source(t)
            if source is not None:
                found = source.device if not tf_compat.is_symbolic(source) else self.device_of(source)
            elif t.op.type in ordering.FUNCTION_OPS:
                found = ""
            else:
                found = self._choose(t.op)
            self._devices[key] = found or ""
        return self._devices[key]


def _size(t: tf.Tensor) -> float:
    shape = t.shape
    if shape.rank is None:
        return float("inf")
    n = 1.0
    for d in shape:
        n *= float("inf") if d is None else d
    return n
