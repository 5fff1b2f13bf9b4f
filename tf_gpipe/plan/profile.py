"""Profile each layer once: forward and backward seconds, the bytes its backward keeps, its weights.

Every quantity is measured at two batch sizes and kept as an :class:`Affine` cost
``fixed + per_example * n``, so that the planner can price any micro-batch size:
a GPU step has a fixed launch cost that a purely proportional model would miss.
Times come from ``tf_gpipe.balance.profile.median_times``, of a forward-only step
and a forward+backward step, so the backward is their difference; a layer with weights
is also timed with a backward w.r.t. its input only and w.r.t. its weights only, the
halves a split schedule (zb-h1) runs as B and W. The bytes a
backward keeps are read from the traced gradient graph: the forward tensors read by the
gradient ops that need the output gradient (what a tape, or ``remat="never"``, holds); a
gradient op that reads forward tensors only runs while the forward does, so what it makes
is kept instead of what it reads. The bytes a layer
needs while it runs are measured: the allocator's peak over each of the two steps,
above its input (``get_memory_info``; on CPU only with ``TF_CPU_ALLOCATOR_USE_BFC=true``).
That peak holds what no graph shows: a CPU convolution's gradient buffers (up to
32 MiB a layer, whatever the batch), fused BatchNorm's reserve space, the gradients
in flight. Without allocator statistics it is estimated from the graph reading.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_gpipe import keras_compat, tf_compat, weight_split
from tf_gpipe.balance.profile import (
    allocator_name,
    allocator_peaks,
    listed_layers,
    median_times,
    nbytes,
    run_unsplit,
    sandbox,
)
from tf_gpipe.cell import layer_kwargs
from tf_gpipe.partition import cuts_keeping, shared_weights, tied

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
    its input for the weight gradient, a ReLU its output). ``forward_peak`` and
    ``backward_peak``: the most bytes beyond its input the layer holds while its
    forward alone runs, and while its forward and backward run (its kept tensors,
    output, gradients and every buffer its ops take).

    ``input_grad_s`` and ``weight_grad_s``: its backward w.r.t. its input only, and
    w.r.t. its weights only (a split schedule's B and W; ``backward_s`` holds both).
    For a layer without weights the first is its backward and the second zero; the
    model's first layer gets no input gradient, so its first is zero and its second
    its backward. None where not measured (a hand-made profile): half the backward each.
    ``weight_shapes``: (shape, bytes per element) of each trainable weight.
    ``weight_half_bytes``: what a split backward's W holds of the layer from its B (the
    inputs, but the weights, of its ops that read a weight, and their output gradients:
    ``tf_gpipe.stash``); None where not measured (then all it keeps).
    ``host_share``: the share of the host's processors its forward and backward keep busy
    while they run alone (processor seconds over wall seconds times processors, at the
    larger size, in ``[0, 1]``): what devices that share one host (logical CPUs) contend
    for. None where not measured.
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
    forward_peak: Affine = ZERO
    backward_peak: Affine = ZERO
    input_grad_s: Affine | None = None
    weight_grad_s: Affine | None = None
    weight_shapes: tuple[tuple[tuple[int, ...], int], ...] = ()
    host_share: float | None = None
    weight_half_bytes: Affine | None = None


@dataclass(frozen=True)
class ModelProfile:
    """The layers' profiles, and what calling a function costs once per stage action.

    Each layer is timed as a function of its own, so each layer's time holds one
    call's overhead; that overhead (timed on an empty function) is taken out of every
    layer and kept here, to be paid once per stage action, as the stages run.
    """

    layers: list[LayerProfile]
    forward_call_s: Affine
    backward_call_s: Affine
    # Where a stage may begin (before layer c), where layers share a layer or variable: a
    # cut between two uses would put it on two devices. None: anywhere.
    cuts: tuple[int, ...] | None = None
    # Each trainable weight several layers use (a tied embedding): (the positions of the
    # layers using it, its bytes). Each of those layers' ``trainable_bytes`` counts it.
    shared: tuple[tuple[tuple[int, ...], int], ...] = ()
    # The items are a functional model's nodes (``tf_gpipe.plan`` of a functional model): a
    # plan's balance then counts nodes, for ``PipelineModel.from_model``.
    of_graph: bool = False


def _forward_step(layer: keras.layers.Layer, mask: Any) -> Callable[[Any], tf.Tensor]:
    kwargs = layer_kwargs(layer, mask, True)

    @tf_compat.function(autograph=False)
    def step(x):
        flat = [t for t in tf.nest.flatten(layer(x, **kwargs)) if t is not None and t.dtype.is_floating]
        # One scalar that needs every output: nothing is pruned, and reading it waits for the device.
        return tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32)) for t in flat] or [tf.constant(0.0)])

    return step


class _Nothing(keras.layers.Layer):
    """The identity, as a layer: timing it gives a function call's own cost."""

    def call(self, x):
        return x


# Ops whose output shares its input's buffer: a kept view costs what its source costs.
_VIEWS = {
    "Reshape",
    "Identity",
    "IdentityN",
    "Squeeze",
    "ExpandDims",
    "EnsureShape",
    "Snapshot",
    "StopGradient",
}


def _source(t: tf.Tensor) -> tf.Tensor:
    while t.op.type in _VIEWS and t.op.inputs and t.dtype != tf.resource:
        t = t.op.inputs[0 if t.op.type != "IdentityN" else t.value_index]
    return t


def _taped_step(
    layer: keras.layers.Layer,
    mask: Any,
    input_grads: bool = True,
    weight_grads: bool = True,
    gated: bool = True,
) -> tuple[Any, dict]:
    """The layer's forward and backward as one function (timed, and measured with the allocator),
    and marks that let :func:`_kept` read its traced graph: where the forward ends, its outputs.
    The first layer gets no input gradient, as in the pipeline (the data need none);
    ``weight_grads=False`` (or ``input_grads=False``) differentiates w.r.t. the input (the
    weights) only: a split schedule's B (W). ``gated``: the gradient as the stages take it
    (timed); ungated, the graph :func:`_kept` reads (gating's groups tie each op's gradients
    together, which says nothing of what the forward must keep) and the step whose
    allocator peak is read."""
    kwargs, marks = layer_kwargs(layer, mask, True), {}

    @tf_compat.function(autograph=False)
    def step(x):
        watched = [t for t in tf.nest.flatten(x) if t is not None and t.dtype.is_floating]
        watched = watched if input_grads else []
        y = layer(x, **kwargs)
        flat = [t for t in tf.nest.flatten(y) if t is not None and t.dtype.is_floating]
        loss = tf.add_n([tf.reduce_sum(t) for t in flat] or [tf.constant(0.0)])
        marks["forward_ops"] = len(tf.compat.v1.get_default_graph().get_operations())
        marks["outputs"] = flat
        # The output gradients start from one op (in a pipeline they come from the next stage,
        # late): what needs it cannot run before the backward starts; see _kept.
        seed = tf.identity(tf.constant(1.0), name="planner_output_gradient")
        marks["seed"] = seed.op
        sources = watched + (list(layer.trainable_variables) if weight_grads else [])
        grads = []  # nothing to differentiate, or nothing to differentiate by
        if flat and sources:
            # As the stages differentiate (``replay.tape_gradients``, ``tf_gpipe.gated``):
            # tf.gradients gated, each op handing on its gradients together.
            grads = tf.gradients(
                flat,
                [keras_compat.backing_variable(v) if isinstance(v, keras.Variable) else v for v in sources],
                grad_ys=[tf.fill(tf.shape(t), tf.cast(seed, t.dtype)) for t in flat],
                unconnected_gradients=tf.UnconnectedGradients.NONE,
                gate_gradients=gated,
            )
        # One scalar that needs every gradient: nothing is pruned, and reading it waits for the device.
        return tf.add_n([loss] + [tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads if g is not None])

    return step, marks


def _kept(graph: Any, marks: dict) -> tuple[int, bool, bool]:
    """(bytes of the forward tensors the gradient keeps, other than input and output;
    whether it keeps the input; whether it keeps the output), from the traced graph of
    :func:`_taped_step`. A kept view (a reshape) counts as its source. Only the gradient ops
    that need the output gradient wait for the backward; the others (reading forward tensors
    only) run as soon as their inputs exist, so their outputs are kept, not their inputs."""
    ops = graph.get_operations()
    # Backward ops that need no output gradient (they read forward tensors only) run as soon
    # as the forward has made their inputs, while it runs; only what the others read is kept.
    late = {id(marks["seed"])}
    for op in ops[marks["forward_ops"] :]:
        if any(id(t.op) in late for t in op.inputs) or any(id(c) in late for c in op.control_inputs):
            late.add(id(op))
    early = {id(op) for op in ops if id(op) not in late}
    seen: set[int] = set()
    kept_tensors = []
    for op in ops[marks["forward_ops"] :]:
        if op.type in _SHAPE_READERS or id(op) not in late:
            continue
        for t in op.inputs:
            if id(t.op) not in early:
                continue
            t = _source(t)
            if id(t) not in seen:
                seen.add(id(t))
                kept_tensors.append(t)
    inputs = {id(t) for t in graph.inputs}
    uses_input = any(id(t) in inputs and t.dtype != tf.resource for t in kept_tensors)
    # The graph's own tensors for the layer's outputs, or their sources where they are views.
    outputs = {id(_source(t)) for t in marks["outputs"]} - inputs
    saves_output = any(id(t) in outputs for t in kept_tensors)
    internal = 0
    for t in kept_tensors:
        if id(t) in inputs or id(t) in outputs or t.op.type in _NOT_KEPT:
            continue
        if t.dtype == tf.resource or t.shape.rank is None or None in t.shape.as_list():
            continue  # no activation, or a size only known at run time: not counted
        internal += int(np.prod(t.shape.as_list())) * t.dtype.size
    return internal, uses_input, saves_output


def _weight_half(layer: keras.layers.Layer, mask: Any, x: Any) -> int | None:
    """``weight_split.weight_half_bytes`` of the layer's forward on ``x``."""
    kwargs = layer_kwargs(layer, mask, True)
    concrete = tf_compat.function(lambda t: layer(t, **kwargs), autograph=False).get_concrete_function(x)
    n_args = len([t for t in tf.nest.flatten(x) if t is not None])
    at = {id(h): n_args + i for i, h in enumerate(concrete.captured_inputs)}
    handles = [keras_compat.backing_variable(v).handle for v in layer.trainable_weights]
    return weight_split.weight_half_bytes(concrete, n_args, [at[id(h)] for h in handles if id(h) in at])


def _fit_known(n1: int, v1: float | None, n2: int, v2: float | None) -> Affine | None:
    return None if v1 is None or v2 is None else Affine.fit(n1, v1, n2, v2)


def _copy(t: Any) -> Any:
    return tf.identity(t) if isinstance(t, tf.Tensor) else t


def _estimated_peaks(
    layer: keras.layers.Layer, record: tuple, kept: tuple[int, bool, bool], input_grads: bool
) -> tuple[int, int]:
    """(forward, backward) peak bytes beyond the input, from sizes alone (no allocator statistics):
    the output; then what the backward keeps, the output's gradient, the input's and the weights'."""
    x, _, y = record
    internal, _, saves_output = kept
    out = nbytes(y) * (2 if saves_output else 1)
    return nbytes(y), internal + out + (nbytes(x) if input_grads else 0) + nbytes(layer.trainable_weights)


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


def _backward_time(
    t1: list[float], t2: list[float], n1: int, n2: int, step: int, forward: int, call1: float, call2: float
) -> Affine:
    """The backward in the taped step at ``step``: its time less its forward's and one call's."""
    b1, b2 = max(t1[step] - t1[forward] - call1, 0.0), max(t2[step] - t2[forward] - call2, 0.0)
    return Affine.fit(n1, b1, n2, b2)


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
    layer_list, spec = listed_layers(layers)
    sample = spec if sample is None else sample
    if sample is None:
        raise ValueError(
            "tf_gpipe: plan needs sample_input: a batch, a shape such as (32, 784), or keras.Input."
        )
    sizes = sorted({int(min(batch_sizes)), int(max(batch_sizes))})
    allocator = allocator_name(device)
    per_size = []
    for n in sizes:
        _, records = run_unsplit(layer_list, _at_batch(sample, n), n)
        nothing = _Nothing(name="planner_call_overhead")
        steps: list[Callable[[], tf.Tensor]] = []
        ungated: list[Callable[[], tf.Tensor]] = []  # the same steps, the backward ungated
        taped = []
        with tf.device(device):  # the inputs live where the steps run: the peaks exclude them
            inputs = [tf.nest.map_structure(_copy, x) for x, _, _ in records]
        timed = [(nothing, inputs[0], records[0])] + list(zip(layer_list, inputs, records))
        halves: list[Callable[[], tf.Tensor]] = []  # per layer with weights: input only, weights only
        for j, (layer, x, (_, mask, _)) in enumerate(timed):
            step = _taped_step(layer, mask, input_grads=j != 1)[0]
            read, marks = _taped_step(layer, mask, input_grads=j != 1, gated=False)
            forward = partial(_forward_step(layer, mask), x)
            steps += [forward, partial(step, x)]
            ungated += [forward, partial(read, x)]
            taped.append((read, marks, x))
            if j > 1 and layer.trainable_weights:
                for grads in ({"weight_grads": False}, {"input_grads": False}):
                    halves.append(partial(_taped_step(layer, mask, **grads)[0], x))
        cpu: list[float] = []
        with tf.device(device), sandbox(layer_list):
            times = median_times(steps + halves, warmup, repeats, cpu=cpu)
            # Peaks of the ungated steps: gating's groups keep gradients alive in a
            # one-layer step that the pipeline's stages free, so the gated peaks read 20-25%
            # above what a Transformer's devices held, the ungated within 2-15%.
            peaks = allocator_peaks(ungated, allocator) if allocator else None
            kept = [_kept(read.get_concrete_function(x).graph, marks) for read, marks, x in taped[1:]]
            w_held = [_weight_half(layer, mask, x) for layer, x, (_, mask, _) in timed[1:]]
        per_size.append((n, records, times, kept, peaks, cpu, w_held))
    (n1, rec1, t1, k1, p1, _, w1), (n2, rec2, t2, k2, p2, cpu2, w2) = per_size[0], per_size[-1]
    processors = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    out = []
    # Entries 0, 1: the empty function's forward and forward+backward; layer i at 2i+2, 2i+3;
    # after them the two halves of each layer with weights but the first, in order.
    call_f1, call_f2 = t1[0], t2[0]
    call_b1, call_b2 = max(t1[1] - t1[0], 0.0), max(t2[1] - t2[0], 0.0)
    half = 2 * len(layer_list) + 2
    for i, layer in enumerate(layer_list):
        fwd1, fwd2 = max(t1[2 * i + 2] - call_f1, 0.0), max(t2[2 * i + 2] - call_f2, 0.0)

        backward_s = _backward_time(t1, t2, n1, n2, 2 * i + 3, 2 * i + 2, call_b1, call_b2)
        if i == 0:  # no input gradient: its backward is all weight gradient
            input_grad_s, weight_grad_s = ZERO, backward_s
        elif not layer.trainable_weights:
            input_grad_s, weight_grad_s = backward_s, ZERO
        else:
            input_grad_s, weight_grad_s = (
                _backward_time(t1, t2, n1, n2, k, 2 * i + 2, call_b1, call_b2) for k in (half, half + 1)
            )
            half += 2
        sizes_of = [(n, rec[i], k[i], p and (p[2 * i + 2], p[2 * i + 3])) for n, rec, k, p in
                    ((n1, rec1, k1, p1), (n2, rec2, k2, p2))]  # fmt: skip
        peaks_at = [pk or _estimated_peaks(layer, r, kk, i > 0) for _, r, kk, pk in sizes_of]
        out.append(
            LayerProfile(
                name=layer.name,
                trainable_bytes=nbytes(layer.trainable_weights),
                non_trainable_bytes=nbytes(layer.non_trainable_weights),
                forward_s=Affine.fit(n1, fwd1, n2, fwd2),
                backward_s=backward_s,
                input_bytes=Affine.fit(n1, nbytes(rec1[i][0]), n2, nbytes(rec2[i][0])),
                output_bytes=Affine.fit(n1, nbytes(rec1[i][2]), n2, nbytes(rec2[i][2])),
                saved_bytes=Affine.fit(n1, k1[i][0], n2, k2[i][0]),
                uses_input=k1[i][1] or k2[i][1],
                saves_output=k1[i][2] or k2[i][2],
                forward_peak=Affine.fit(n1, peaks_at[0][0], n2, peaks_at[-1][0]),
                backward_peak=Affine.fit(n1, peaks_at[0][1], n2, peaks_at[-1][1]),
                input_grad_s=input_grad_s,
                weight_grad_s=weight_grad_s,
                weight_shapes=tuple(
                    (tuple(int(d) for d in w.shape), tf.as_dtype(w.dtype).size)
                    for w in layer.trainable_weights
                ),
                # The taped step (forward and backward) at the larger size.
                host_share=min(max(cpu2[2 * i + 3] / max(t2[2 * i + 3] * processors, 1e-12), 0.0), 1.0),
                weight_half_bytes=_fit_known(n1, w1[i], n2, w2[i]),
            )
        )
    spans = tied(layer_list)
    cuts = tuple(cuts_keeping(len(layer_list), spans)) if spans else None
    shared = tuple((at, nbytes([v])) for v, at in shared_weights(layer_list))
    call_f, call_b = Affine.fit(n1, call_f1, n2, call_f2), Affine.fit(n1, call_b1, n2, call_b2)
    return ModelProfile(out, call_f, call_b, cuts, shared)
