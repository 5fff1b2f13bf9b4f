"""Per-layer cost estimates for balancing: parameters, training memory, measured time."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, TypeAlias, cast

import keras
import numpy as np
import tensorflow as tf

from tf_gpipe import keras_compat, tf_compat
from tf_gpipe.cell import eager_build_scope, layer_kwargs

__all__ = ["by_memory", "by_params", "by_time"]

Layers: TypeAlias = Sequence[keras.layers.Layer] | keras.Sequential


def listed_layers(layers: Any) -> tuple[list[keras.layers.Layer], Any]:
    """The layers as a list, and the input spec of a leading ``keras.Input`` (else None)."""
    spec, layers = None, layers.layers if isinstance(layers, keras.Sequential) else layers
    if isinstance(layers, keras.layers.Layer):
        raise TypeError(f"tf_gpipe: `layers` must be a list, got the layer {layers.name!r}; pass [layer].")
    layers = list(layers)
    if layers and isinstance(layers[0], (keras.KerasTensor, keras.layers.InputLayer)):
        first = layers.pop(0)
        spec = first.output if isinstance(first, keras.layers.InputLayer) else first
    if not layers:
        raise ValueError("tf_gpipe: `layers` is empty; give at least one Keras layer.")
    for i, layer in enumerate(layers):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(f"tf_gpipe: layers[{i}] is {type(layer).__name__}, not a Keras layer.")
    return layers, spec


def _inputs(sample: Any, batch_size: int) -> Any:
    """Tensors for ``sample``: data as given; shapes and specs filled with N(0, 1) (zeros if not float)."""
    if sample is None:
        raise ValueError("tf_gpipe: pass a sample: a batch, a shape such as (32, 784), or keras.Input first.")
    rng = np.random.RandomState(0)  # fixed data; the global NumPy and Keras seeds stay untouched

    def fill(spec_shape: Sequence[int | None], dtype: Any) -> tf.Tensor:
        dims = [batch_size if i == 0 and d is None else d for i, d in enumerate(spec_shape)]
        if None in dims:
            raise ValueError(f"tf_gpipe: the sample shape {tuple(dims)} has a None; give every dimension.")
        shape = cast(list[int], dims)
        if tf.as_dtype(dtype).is_floating:
            return tf.cast(rng.standard_normal(shape).astype(np.float32), dtype)
        return tf.zeros(shape, tf.as_dtype(dtype))  # valid token ids and masks

    if (
        isinstance(sample, (tuple, list, tf.TensorShape))
        and sample
        and all(d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in sample)
    ):
        return fill(list(sample), "float32")

    def one(t: Any) -> Any:
        if isinstance(t, (keras.KerasTensor, tf.TensorSpec)):
            return fill(list(t.shape), t.dtype)
        return t if t is None else tf.convert_to_tensor(t)

    return tf.nest.map_structure(one, sample)


@contextlib.contextmanager
def sandbox(layers: Sequence[keras.layers.Layer]) -> Iterator[None]:
    """Undo what running the layers changes (BatchNorm statistics, Dropout seeds), or estimating
    costs would shift every later Dropout mask. Like torchgpipe's ``training_sandbox``."""
    saved = [(v, tf.identity(v.value)) for layer in layers for v in layer.non_trainable_variables]
    try:
        yield
    finally:
        for v, value in saved:
            v.assign(value)


def run_unsplit(layers: Layers, sample: Any, batch_size: int) -> tuple[list[keras.layers.Layer], list[tuple]]:
    """Apply (and so build) the layers in order, unsplit, on CPU, in inference mode: (x, mask, y) each."""
    layers, spec = listed_layers(layers)
    records, mask = [], None
    with eager_build_scope("/device:CPU:0"), sandbox(layers):
        x = _inputs(spec if sample is None else sample, batch_size)
        for i, layer in enumerate(layers):
            try:
                y = layer(x, **layer_kwargs(layer, mask, False))
            except Exception as e:  # name the layer: the traceback alone is hard to read
                shapes = tf.nest.map_structure(lambda t: tuple(t.shape), x)
                raise type(e)(f"tf_gpipe: running layers[{i}] ({layer.name!r}) on {shapes}: {e}") from e
            records.append((x, mask, y))
            mask = tf.nest.map_structure(keras_compat.get_keras_mask, y)
            mask = None if all(m is None for m in tf.nest.flatten(mask)) else mask
            x = y
    return layers, records


def nbytes(structure: Any) -> int:
    flat = [t for t in tf.nest.flatten(structure) if t is not None]
    return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in flat)


def by_params(layers: Layers, sample: Any = None, *, batch_size: int = 32) -> list[float]:
    """Each layer's parameter count (``layer.count_params()``, trainable or not); a layer
    listed twice counts at its first entry.

    Args:
        layers: Keras layers applied in order (a list or ``keras.Sequential``); a
            leading ``keras.Input`` can stand in for ``sample``.
        sample: a batch (array, tensor or a nest of them), a full float32 shape
            such as ``(32, 784)``, or ``keras.KerasTensor``/``tf.TensorSpec`` (any
            dtype). The layers are built by running them once on it, in order, on CPU.
        batch_size: fills an unknown (``None``) batch dimension of a spec.

    Returns:
        One float per layer.

    Example:
        >>> by_params([keras.layers.Dense(4), keras.layers.Dense(2)], (8, 3))
        [16.0, 10.0]
    """
    layer_list, _ = run_unsplit(layers, sample, batch_size)
    once = _first_uses(layer_list)
    return [float(layer.count_params()) if first else 0.0 for layer, first in zip(layer_list, once)]


def _first_uses(layer_list: list) -> list[bool]:
    """Whether each entry is its layer's first in the list: a layer listed twice holds its
    weights once (its uses share a stage, ``partition.default_balance``)."""
    seen: set = set()
    first = []
    for layer in layer_list:
        first.append(id(layer) not in seen)
        seen.add(id(layer))
    return first


def by_memory(
    layers: Layers, sample: Any = None, *, optimizer_slots: int = 2, batch_size: int = 32
) -> list[float]:
    """Bytes each layer holds in training: its parameters, plus its output for ``sample``.

    A trainable weight counts ``2 + optimizer_slots`` times (itself, its summed
    gradient, e.g. Adam's two moments), a non-trainable one once, at the layer's first
    entry in the list. The output is for the sample batch: make it what a stage stashes
    (GPipe: the mini-batch).

    Args:
        layers, sample, batch_size: as for :func:`by_params`.
        optimizer_slots: slot variables per trainable weight (Adam 2, momentum 1, SGD 0).

    Returns:
        Bytes per layer, as floats.

    Example:
        >>> by_memory([keras.layers.Dense(4)], (8, 3), optimizer_slots=0)  # (16 * 2 + 8 * 4) * 4 bytes
        [256.0]
    """
    layer_list, records = run_unsplit(layers, sample, batch_size)
    out = []
    for layer, (_, _, y), first in zip(layer_list, records, _first_uses(layer_list)):
        trainable, frozen = nbytes(layer.trainable_weights), nbytes(layer.non_trainable_weights)
        weights = (2 + optimizer_slots) * trainable + frozen if first else 0
        out.append(float(weights + nbytes(y)))
    return out


def _grad_step(layer: keras.layers.Layer, mask: Any) -> Callable[[Any], tf.Tensor]:
    kwargs = layer_kwargs(layer, mask, True)

    @tf_compat.function(autograph=False)  # plain Python: nothing to convert
    def step(x):
        watched = [t for t in tf.nest.flatten(x) if t is not None and t.dtype.is_floating]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            flat = [t for t in tf.nest.flatten(layer(x, **kwargs)) if t is not None]
            sums = [tf.reduce_sum(tf.cast(t, tf.float32)) for t in flat if t.dtype.is_floating]
            loss = tf.add_n(sums) if sums else tf.constant(0.0)
        grads = tape.gradient(loss, watched + list(layer.trainable_variables))
        # One scalar that needs every gradient: nothing is pruned, and reading it waits for the device.
        return tf.add_n([loss] + [tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads if g is not None])

    return step


def by_time(
    layers: Layers,
    sample: Any = None,
    *,
    repeats: int = 10,
    warmup: int = 2,
    device: str = "/device:CPU:0",
    batch_size: int = 32,
) -> list[float]:
    """Each layer's forward plus backward time on ``sample``, in seconds (median of ``repeats``).

    A ``tf.function`` per layer runs it in training mode under a ``GradientTape``
    and takes the gradient of its summed outputs with respect to its float inputs
    and trainable weights; its input is the previous layer's output. BatchNorm
    statistics and Dropout seeds are put back after. Weights stay where they were
    built (CPU): on a GPU ``device`` the time includes reading them across.

    Args:
        layers, sample, batch_size: as for :func:`by_params`; the sample's batch is timed.
        repeats: timed calls per layer, taken in turns over the layers; the median is kept.
        warmup: untimed calls after the first (tracing) one.
        device: where the ops run.

    Returns:
        Seconds per layer, as floats.

    Example:
        >>> by_time([keras.layers.Dense(512), keras.layers.Dense(8)], (64, 512))  # doctest: +SKIP
        [0.00091, 0.00012]
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"tf_gpipe: need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}.")
    layer_list, records = run_unsplit(layers, sample, batch_size)
    steps = [partial(_grad_step(layer, mask), x) for layer, (x, mask, _) in zip(layer_list, records)]
    # Not eager_build_scope: tf.init_scope pauses gradient tapes, so the backward would be skipped.
    with tf.device(device), sandbox(layer_list):
        return median_times(steps, warmup, repeats)


def median_times(
    steps: Sequence[Callable[[], tf.Tensor]], warmup: int, repeats: int, cpu: list[float] | None = None
) -> list[float]:
    """Each step's median seconds over ``repeats`` calls, after a tracing call and ``warmup`` more.

    Shared by ``by_time`` and ``tf_gpipe.graph.node_costs``. Reading each result
    waits for the device, so a call's time is its whole run. ``cpu``, if given, receives
    each step's median processor seconds (the process's, every thread's) over the same calls.
    """
    times: list[list[float]] = [[] for _ in steps]
    used: list[list[float]] = [[] for _ in steps]
    for _ in range(1 + warmup + repeats):  # the first call traces
        for step, record, spent in zip(steps, times, used):  # round-robin: load hits every step alike
            start, start_cpu = time.perf_counter(), time.process_time()
            step().numpy()
            record.append(time.perf_counter() - start)
            spent.append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu[:] = [float(statistics.median(spent[1 + warmup :])) for spent in used]
    return [float(statistics.median(record[1 + warmup :])) for record in times]


def allocator_name(device: str) -> str | None:
    """The name ``get_memory_info`` knows ``device`` by, or None where its allocator keeps no
    statistics (CPU without ``TF_CPU_ALLOCATOR_USE_BFC=true``)."""
    spec = tf.DeviceSpec.from_string(device)
    name = f"{spec.device_type or 'CPU'}:{spec.device_index or 0}"
    try:
        tf.config.experimental.get_memory_info(name)
    except ValueError:
        return None
    return name


def allocator_peaks(steps: Sequence[Callable[[], tf.Tensor]], allocator: str) -> list[int]:
    """Each step's allocator peak above what was allocated before it (its input included)."""
    out = []
    for step in steps:
        tf.config.experimental.reset_memory_stats(allocator)
        base = tf.config.experimental.get_memory_info(allocator)["current"]
        step().numpy()
        out.append(max(tf.config.experimental.get_memory_info(allocator)["peak"] - base, 0))
    return out
