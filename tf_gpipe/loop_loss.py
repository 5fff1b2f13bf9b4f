"""A micro-batch's loss inside a loop over micro-batches, and the metric updates it makes.

1F1B, interleaved and ZB-H1 take the loss of each micro-batch right after its last forward,
inside ``tf_gpipe.micro_batch_loop``'s loop body. Keras' loss and a ``compute_loss``
override update metrics there (``Mean`` trackers); in a loop body nothing would keep or
order those updates, so they are recorded instead of made, their tensor arguments leave the
iteration, and the step makes them after the loop, in micro-batch order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_gpipe import keras_compat

__all__: list[str] = []

_TENSOR = object()  # where a recorded metric update took a tensor
# Ops without outputs that change no state (a loss' shape checks; as before, nothing in the
# loop body waits for them).
_NOT_WRITES = frozenset({"Assert", "NoOp", "PrintV2"})


def _constant_part(v: Any) -> Any:
    return _TENSOR if tf.is_tensor(v) else v


def _filled(tensors: Any, v: Any) -> Any:
    return next(tensors) if v is _TENSOR else v


def micro_batch_loss(
    micro_loss: Callable[[Any, Any, Any], tuple[Any, Any]], x: Any, mask: Any, target: Any
) -> tuple[Any, list[Any], list[tuple[Any, Any]], list[tf.Tensor]]:
    """``micro_loss(x, mask, target)``'s loss gradients and terms, with the metric updates it
    made recorded: ``(dy, terms, calls, tensors)``, ``tensors`` what the updates read, to
    leave the iteration, and ``calls`` how to make them again (``replay_metric_updates``).
    Rows (a weight's gradient from an override that gathers from it) come back dense.

    Raises:
        ValueError: the loss writes state other than Keras metrics, which a loop cannot order.
    """
    graph = tf.compat.v1.get_default_graph()
    known = len(graph.get_operations())
    with keras_compat.recorded_metric_updates() as calls:
        dy, terms = micro_loss(x, mask, target)
    made = graph.get_operations()[known:]
    writes = [op.name for op in made if not op.outputs and op.type not in _NOT_WRITES]
    if writes:
        raise ValueError(
            f"tf_gpipe: the loss of each micro-batch changes state other than Keras metrics "
            f"(ops {writes[:3]}), which the loops over micro-batches cannot order; pass "
            "micro_batch_loops=False to PipelineModel."
        )
    recorded = [(m, tf.nest.map_structure(_constant_part, (a, k))) for m, a, k in calls]
    tensors = [t for _, a, k in calls for t in tf.nest.flatten((a, k)) if tf.is_tensor(t)]
    terms = [tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t for t in terms]
    return dy, terms, recorded, tensors


def replay_metric_updates(calls: list[tuple[Any, Any]], rows: Sequence[Sequence[tf.Tensor]]) -> None:
    """Make the metric updates ``calls`` (``micro_batch_loss``'s) once per micro-batch, in
    order, each with that micro-batch's ``rows`` entry (its recorded tensors)."""
    for row in rows:
        given = iter(row)
        for metric, recorded in calls:
            args, kwargs = tf.nest.map_structure(functools.partial(_filled, given), recorded)
            metric.update_state(*args, **kwargs)
