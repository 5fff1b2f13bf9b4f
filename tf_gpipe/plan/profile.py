"""Profile each layer once: forward and backward seconds, the bytes its backward keeps, its weights.

Every quantity is measured at two batch sizes and kept as an :class:`Affine` cost
``fixed + per_example * n``, so that the planner can price any micro-batch size:
a GPU step has a fixed launch cost that a purely proportional model would miss.
Times come from ``tf_gpipe.balance.profile`` (``_grad_step``, ``_median_times``),
with a forward-only step beside it so the backward is their difference. The
bytes a backward keeps are read from the traced gradient graph: the forward
tensors its gradient ops consume (what a tape, or ``remat="never"``, holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, List, Sequence, Set, Tuple

import keras
import numpy as np
import tensorflow as tf

from tf_gpipe.balance.profile import _grad_step, _layer_list, _median_times, _nbytes, _prepare, _sandbox
from tf_gpipe.cell import _layer_kwargs

__all__ = ["Affine", "LayerProfile", "ModelProfile", "profile_layers"]

# Ops whose output is no activation (a variable's buffer, a constant) or that read only a shape.
_NOT_KEPT = {"Placeholder", "ReadVariableOp", "Const", "VarHandleOp", "Shape", "ShapeN", "Size", "Rank"}
_SHAPE_READERS = {"Shape", "ShapeN", "Size", "Rank", "BroadcastArgs", "BroadcastGradientArgs"}


@dataclass(frozen=True)
class Affine:
    """A cost ``fixed + per_example * n`` of a micro-batch of ``n`` examples."""

    fixed: float
    per_example: float

    def at(self, n: float) -> float:
        return self.fixed + self.per_example * n

    @classmethod
    def fit(cls, n1: int, v1: float, n2: int, v2: float) -> Affine:
        """Through ``(n1, v1)`` and ``(n2, v2)``; never negative (timing noise can tilt a line)."""
        if n1 == n2:
            return cls(0.0, max(v1, 0.0) / max(n1, 1))
        slope = max((v2 - v1) / (n2 - n1), 0.0)
        fixed = max(v2 - slope * n2, 0.0)
        return cls(fixed, slope)

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_example + other.per_example)


ZERO = Affine(0.0, 0.0)


@dataclass(frozen=True)
class LayerProfile:
    """What the planner knows of one layer.

    ``saved`` is what the layer's backward keeps beyond its input and its output;
    ``uses_input``/``saves_output`` say whether it keeps those too (a Dense keeps
    its input for the weight gradient, a ReLU its output).
    """

    name: str
    trainable_bytes: int
    non_trainable_bytes: int
    forward_s: Affine
    backward_s: Affine
    input_bytes: Affine
    output_bytes: Affine
    saved_bytes: Affine
    uses_input: bool
    saves_output: bool


@dataclass(frozen=True)
class ModelProfile:
    """The layers' profiles, and what calling a function costs once per stage action.

    Each layer is timed as a function of its own, so each layer's time holds one
    call's overhead; that overhead (timed on an empty function) is taken out of every
    layer and kept here, to be paid once per stage action, as the stages run.
    """

    layers: List[LayerProfile]
    forward_call_s: Affine
    backward_call_s: Affine


def _forward_step(layer: keras.layers.Layer, mask: Any) -> Callable[[Any], tf.Tensor]:
    kwargs = _layer_kwargs(layer, mask, True)

    @tf.function(autograph=False)
    def step(x):
        flat = [t for t in tf.nest.flatten(layer(x, **kwargs)) if t is not None and t.dtype.is_floating]
        # One scalar that needs every output: nothing is pruned, and reading it waits for the device.
        return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in flat] or [tf.constant(0.0)])

    return step


class _Nothing(keras.layers.Layer):
    """The identity, as a layer: timing it gives a function call's own cost."""

    def call(self, x):
        return x


def _kept(layer: keras.layers.Layer, x: Any, mask: Any) -> Tuple[int, bool, bool]:
    """(bytes of the forward tensors the gradient keeps, other than input and output;
    whether it keeps the input; whether it keeps the output), from the traced graph."""
    kwargs, marks = _layer_kwargs(layer, mask, True), {}

    def step(x):
        watched = [t for t in tf.nest.flatten(x) if t is not None and t.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            y = layer(x, **kwargs)
            flat = [t for t in tf.nest.flatten(y) if t is not None and t.dtype.is_floating]
            loss = tf.add_n([tf.reduce_sum(t) for t in flat] or [tf.constant(0.0)])
        marks["forward_ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        marks["outputs"] = {id(t) for t in flat}
        return tape.gradient(loss, watched + list(layer.trainable_variables))

    graph = tf.function(step, autograph=False).get_concrete_function(x).graph
    ops = graph.get_operations()
    forward = {id(op) for op in ops[: marks["forward_ops"]]}
    kept: Set[int] = set()
    kept_tensors = []
    for op in ops[marks["forward_ops"] :]:
        if op.type in _SHAPE_READERS:
            continue
        for t in op.inputs:
            if id(t.op) in forward and id(t) not in kept:
                kept.add(id(t))
                kept_tensors.append(t)
    inputs = {id(t) for t in graph.inputs}
    uses_input = any(id(t) in inputs and t.dtype != tf.resource for t in kept_tensors)
    # The graph's own tensors for the layer's outputs (the marks are the traced ones).
    saves_output = any(id(t) in marks["outputs"] for t in kept_tensors)
    internal = 0
    for t in kept_tensors:
        if id(t) in inputs or id(t) in marks["outputs"] or t.op.type in _NOT_KEPT:
            continue
        if t.dtype == tf.resource or t.shape.rank is None or None in t.shape.as_list():
            continue  # no activation, or a size only known at run time: not counted
        internal += int(np.prod(t.shape.as_list())) * t.dtype.size
    return internal, uses_input, saves_output


def _at_batch(sample: Any, n: int) -> Any:
    """``sample`` with its batch dimension set to ``n``: a shape's first entry, a spec's, or rows
    of data repeated or cut."""
    if (
        isinstance(sample, (tuple, list, tf.TensorShape))
        and sample
        and all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in sample)
    ):
        return (n,) + tuple(sample)[1:]

    def one(t: Any) -> Any:
        if t is None:
            return None
        if isinstance(t, (keras.KerasTensor, tf.TensorSpec)):
            return tf.TensorSpec((n,) + tuple(t.shape)[1:], t.dtype)
        t = tf.convert_to_tensor(t)
        if t.shape.rank == 0 or t.shape[0] == 0:
            raise ValueError("tf_gpipe: sample_input must be batched: give at least one example.")
        reps = -(-n // int(t.shape[0]))
        return tf.concat([t] * reps, 0)[:n] if reps > 1 else t[:n]

    return tf.nest.map_structure(one, sample)


def profile_layers(
    layers: Any,
    sample: Any,
    batch_sizes: Sequence[int],
    *,
    repeats: int = 5,
    warmup: int = 1,
    device: str = "/device:CPU:0",
) -> ModelProfile:
    """One :class:`LayerProfile` per layer, measured at (up to) two batch sizes.

    Args:
        layers: Keras layers (a list, or a ``keras.Sequential``); a leading
            ``keras.Input`` can stand in for ``sample``.
        sample: a batch, a shape such as ``(32, 784)``, or a ``keras.Input``/spec;
            its batch dimension is replaced by each batch size.
        batch_sizes: the micro-batch sizes to measure at: the smallest and the
            largest are measured, every cost is a line through them.
        repeats, warmup: timed and untimed calls per layer and size (median kept).
        device: where the ops run.

    Returns:
        A :class:`ModelProfile`: one profile per layer, in order, and the call overhead.
    """
    layer_list, spec = _layer_list(layers)
    sample = spec if sample is None else sample
    if sample is None:
        raise ValueError(
            "tf_gpipe: plan needs sample_input: a batch, a shape such as (32, 784), or keras.Input."
        )
    sizes = sorted({int(min(batch_sizes)), int(max(batch_sizes))})
    per_size = []
    for n in sizes:
        _, records = _prepare(layer_list, _at_batch(sample, n), n)
        nothing = _Nothing(name="planner_call_overhead")
        steps: List[Callable[[], tf.Tensor]] = []
        for layer, (x, mask, _) in [(nothing, records[0])] + list(zip(layer_list, records)):
            steps.append(partial(_forward_step(layer, mask), x))
            steps.append(partial(_grad_step(layer, mask), x))
        with tf.device(device), _sandbox(layer_list):
            times = _median_times(steps, warmup, repeats)
            kept = [_kept(layer, x, mask) for layer, (x, mask, _) in zip(layer_list, records)]
        per_size.append((n, records, times, kept))
    (n1, rec1, t1, k1), (n2, rec2, t2, k2) = per_size[0], per_size[-1]
    out = []
    # Entries 0, 1: the empty function's forward and forward+backward; layer i at 2i+2, 2i+3.
    call_f1, call_f2 = t1[0], t2[0]
    call_b1, call_b2 = max(t1[1] - t1[0], 0.0), max(t2[1] - t2[0], 0.0)
    for i, layer in enumerate(layer_list):
        fwd1, fwd2 = max(t1[2 * i + 2] - call_f1, 0.0), max(t2[2 * i + 2] - call_f2, 0.0)
        bwd1 = max(t1[2 * i + 3] - t1[2 * i + 2] - call_b1, 0.0)
        bwd2 = max(t2[2 * i + 3] - t2[2 * i + 2] - call_b2, 0.0)
        out.append(
            LayerProfile(
                name=layer.name,
                trainable_bytes=_nbytes(layer.trainable_weights),
                non_trainable_bytes=_nbytes(layer.non_trainable_weights),
                forward_s=Affine.fit(n1, fwd1, n2, fwd2),
                backward_s=Affine.fit(n1, bwd1, n2, bwd2),
                input_bytes=Affine.fit(n1, _nbytes(rec1[i][0]), n2, _nbytes(rec2[i][0])),
                output_bytes=Affine.fit(n1, _nbytes(rec1[i][2]), n2, _nbytes(rec2[i][2])),
                saved_bytes=Affine.fit(n1, k1[i][0], n2, k2[i][0]),
                uses_input=k1[i][1] or k2[i][1],
                saves_output=k1[i][2] or k2[i][2],
            )
        )
    return ModelProfile(out, Affine.fit(n1, call_f1, n2, call_f2), Affine.fit(n1, call_b1, n2, call_b2))
