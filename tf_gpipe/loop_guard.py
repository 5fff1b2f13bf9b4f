"""A loop iteration's work skipped where a device's micro-batch counter is past the last.

ZB-H1's loop runs stage s's W(m) in iteration m + s (``schedules.loop_waits.weight_lags``),
so the last W's fall after the last micro-batch. Run after the loop, each would be one
more copy of a stage's backward in the step, which TensorFlow optimizes at the first step
(2-3 s at K=4, most of it Grappler's; benchmarks/first_step/README.md). Instead the loop
runs a few iterations more, in which ``run_below`` skips the forwards, the loss and the
B's (and what they emit), and the W's run in their one place.

A ``tf.cond`` over the iteration would skip it as one op, which TensorFlow lowers to
Switch and Merge nodes with every Merge on one device: each stage's results would cross
to that device and back in every iteration (zb-h1, K=4 on logical CPUs: 336 more
transfers an iteration, a 40% slower step). Here the same dataflow is spelled out per
device: each device's counter makes a pivot that is dead where the iteration is skipped,
every op of the iteration that reads nothing else it made waits for its device's pivot
(TensorFlow's executor passes a dead input on: everything after it is skipped), and each
value the iteration changed is merged with the value before it on the device that made it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import ordering, tf_compat

__all__: list[str] = []


class _Pivots:
    """Per device: whether this iteration runs (its counter below ``M``), a value live only
    where it runs and one live only where it does not."""

    def __init__(self, M: int, counters: Any):
        self.M, self.counters = M, counters
        self.made: dict[str, tuple[tf.Tensor, tf.Tensor, tf.Tensor]] = {}

    def on(self, device: str) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        device = device or self.counters.devices[0]
        if device not in self.made:
            spec = tf.DeviceSpec.from_string(device)
            devices = self.counters.devices
            counter = next((d for d in devices if tf.DeviceSpec.from_string(d) == spec), devices[0])
            with tf.device(device), tf.name_scope("guard"):
                runs = self.counters.on(counter) < self.M
                skipped, ran = tf.raw_ops.Switch(data=runs, pred=runs)
                self.made[device] = (runs, tf.identity(ran), tf.identity(skipped))
        return self.made[device]


def run_below(
    M: int,
    counters: Any,
    state: dict,
    changed: Sequence[Any],
    added: dict[Any, list[tf.TensorSpec]],
    run: Callable[[dict], None],
) -> None:
    """``run(local)``, on a copy of ``state`` it updates, where the iteration's micro-batch
    (``counters.on(device)``, a ``loop_state.Counters``) is below ``M``; ``state`` then
    holds, for each key of ``changed``, what ``run`` left there, or where skipped what it
    held before; for each key of ``added`` (which ``run`` adds, of those specs), what
    ``run`` added, or zeros."""
    graph = tf.compat.v1.get_default_graph()
    pivots = _Pivots(M, counters)
    start = len(graph.get_operations())
    local = dict(state)
    run(local)
    made = graph.get_operations()[start:]
    names = {op.name for op in made}
    for op in made:
        # A function's body, inlined, waits for what its op waits for: one of its outputs that
        # reads none of the op's inputs (a position embedding's rows, a range) stays live.
        if op.type in ordering.FUNCTION_OPS or not any(t.op.name in names for t in op.inputs):
            tf_compat.add_control_input(op, pivots.on(op.device)[1].op)

    def merged(new: Any, old: Any) -> Any:
        if new is old:
            return new
        if isinstance(new, tf.TensorArray):
            return tf.TensorArray(new.dtype, flow=merged(new.flow, old.flow), infer_shape=False)
        runs = pivots.on(new.op.device)[0]
        with tf.device(new.op.device or None), tf.name_scope("guard"):
            before, _ = tf.raw_ops.Switch(data=old, pred=runs)
            value = tf.raw_ops.Merge(inputs=[new, before]).output
        value.set_shape(new.shape)
        return value

    def zeros(new: tf.Tensor, spec: tf.TensorSpec) -> tf.Tensor:
        skipped = pivots.on(new.op.device)[2]
        with tf.device(new.op.device or None), tf.name_scope("guard"):
            with tf.control_dependencies([skipped]):
                zero = tf.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype)
            return tf.raw_ops.Merge(inputs=[new, zero]).output

    for k in changed:
        state[k] = [merged(n, o) for n, o in zip(local[k], state[k])]
    for k, specs in added.items():
        state[k] = [zeros(n, spec) for n, spec in zip(local[k], specs)]
