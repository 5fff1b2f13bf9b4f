"""Order between a pipeline's actions: each waits for what it must, and for nothing else.

The engine's step, built out or as loops, chains each device's actions in the schedule's
order, with control dependencies on tensors, not on ops: the next action's inputs are re-issued
(``after``) so that they wait for what the previous action made ready (``done``)::

    F0@s0 ─► done(outputs) ─► after(start, x) ─► F1@s0
                                                (waits for F0, reads its own input)

Plain dataflow would run every forward as early as it could, and a schedule such as
1F1B then stashes more activations than its order promises.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

__all__: list[str] = []


def after(deps: Sequence[Any], structure: Any) -> Any:
    """``structure`` re-issued so that its consumers wait for ``deps``."""
    deps = [d for d in deps if d is not None]
    if not deps:
        return structure
    with tf.control_dependencies(deps):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), structure)


# The ops a call of a traced function (a stage function) makes in a graph.
CALL_OPS = ("StatefulPartitionedCall", "PartitionedCall")
# Every op whose body is a function: calls, conditionals, loops.
FUNCTION_OPS = frozenset({*CALL_OPS, "If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"})


def done(*structures: Any) -> list[tf.Tensor]:
    """Tensors that are ready once every tensor of ``structures`` is computed.

    Each is read through an Identity: a control dependency on a function's output
    would, were TensorFlow to inline the function, wait only for the function's side
    effects, not for its outputs. The stage functions are never inlined
    (``stage.StageFunctions``) and a call's outputs are ready together, so one output
    of each call stands for all of them: one op per call, not one per tensor.
    """
    out, calls = [], set()
    for s in structures:
        for t in tf.nest.flatten(s):
            if t is None:
                continue
            t = t.values if isinstance(t, tf.IndexedSlices) else t
            if not tf.executing_eagerly() and t.op.type in CALL_OPS:
                if t.op.name in calls:
                    continue
                calls.add(t.op.name)
            out.append(tf.identity(t))
    return out
