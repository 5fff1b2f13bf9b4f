"""Balance a pipeline: estimate each layer's cost, then cut the layers into stages of even cost."""

from __future__ import annotations

import contextlib
import math
import operator
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import keras
import numpy as np
import tensorflow as tf
from keras.src import backend as _kbackend

from tf_gpipe import schedules
from tf_gpipe.cell import _eager_build_scope, _layer_kwargs
from tf_gpipe.devices import default_devices
from tf_gpipe.partition import even_balance, split_by_balance

__all__ = ["METHODS", "SOLVERS", "balance_by", "by_memory", "by_params", "by_time", "report"]
__all__ += ["solve_min_variance", "solve_minmax", "stage_costs"]

Layers = Union[Sequence[keras.layers.Layer], keras.Sequential]
METHODS = ("params", "time", "memory")
SOLVERS = ("minmax", "min_variance")


def _layer_list(layers: Any) -> Tuple[List[keras.layers.Layer], Any]:
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

    def fill(shape: Sequence[Optional[int]], dtype: Any) -> tf.Tensor:
        shape = [batch_size if i == 0 and d is None else d for i, d in enumerate(shape)]
        if None in shape:
            raise ValueError(f"tf_gpipe: the sample shape {tuple(shape)} has a None; give every dimension.")
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
def _sandbox(layers: Sequence[keras.layers.Layer]) -> Iterator[None]:
    """Undo what running the layers changes (BatchNorm statistics, Dropout seeds), or estimating
    costs would shift every later Dropout mask. Like torchgpipe's ``training_sandbox``."""
    saved = [(v, tf.identity(v.value)) for layer in layers for v in layer.non_trainable_variables]
    try:
        yield
    finally:
        for v, value in saved:
            v.assign(value)


def _prepare(layers: Layers, sample: Any, batch_size: int) -> Tuple[List[keras.layers.Layer], List[Tuple]]:
    """Apply (and so build) the layers in order, unsplit, on CPU, in inference mode: (x, mask, y) each."""
    layers, spec = _layer_list(layers)
    records, mask = [], None
    with _eager_build_scope("/device:CPU:0"), _sandbox(layers):
        x = _inputs(spec if sample is None else sample, batch_size)
        for i, layer in enumerate(layers):
            try:
                y = layer(x, **_layer_kwargs(layer, mask, False))
            except Exception as e:  # name the layer: the traceback alone is hard to read
                shapes = tf.nest.map_structure(lambda t: tuple(t.shape), x)
                raise type(e)(f"tf_gpipe: running layers[{i}] ({layer.name!r}) on {shapes}: {e}") from e
            records.append((x, mask, y))
            mask = tf.nest.map_structure(_kbackend.get_keras_mask, y)
            mask = None if all(m is None for m in tf.nest.flatten(mask)) else mask
            x = y
    return layers, records


def _nbytes(structure: Any) -> int:
    flat = [t for t in tf.nest.flatten(structure) if t is not None]
    return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size for t in flat)


def by_params(layers: Layers, sample: Any = None, *, batch_size: int = 32) -> List[float]:
    """Each layer's parameter count (``layer.count_params()``, trainable or not).

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
    layer_list, _ = _prepare(layers, sample, batch_size)
    return [float(layer.count_params()) for layer in layer_list]


def by_memory(
    layers: Layers, sample: Any = None, *, optimizer_slots: int = 2, batch_size: int = 32
) -> List[float]:
    """Bytes each layer holds in training: its parameters, plus its output for ``sample``.

    A trainable weight counts ``2 + optimizer_slots`` times (itself, its summed
    gradient, e.g. Adam's two moments), a non-trainable one once. The output is
    for the sample batch: make it what a stage stashes (GPipe: the mini-batch).

    Args:
        layers, sample, batch_size: as for :func:`by_params`.
        optimizer_slots: slot variables per trainable weight (Adam 2, momentum 1, SGD 0).

    Returns:
        Bytes per layer, as floats.

    Example:
        >>> by_memory([keras.layers.Dense(4)], (8, 3), optimizer_slots=0)  # (16 * 2 + 8 * 4) * 4 bytes
        [256.0]
    """
    layer_list, records = _prepare(layers, sample, batch_size)
    out = []
    for layer, (_, _, y) in zip(layer_list, records):
        weights = (2 + optimizer_slots) * _nbytes(layer.trainable_weights)
        out.append(float(weights + _nbytes(layer.non_trainable_weights) + _nbytes(y)))
    return out


def _grad_step(layer: keras.layers.Layer, mask: Any) -> Callable[[Any], tf.Tensor]:
    kwargs = _layer_kwargs(layer, mask, True)

    @tf.function(autograph=False)  # plain Python: nothing to convert
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
    layers: Layers, sample: Any = None, *, repeats: int = 10, warmup: int = 2,
    device: str = "/device:CPU:0", batch_size: int = 32,
) -> List[float]:  # fmt: skip
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
    layer_list, records = _prepare(layers, sample, batch_size)
    steps = [(_grad_step(layer, mask), x, []) for layer, (x, mask, _) in zip(layer_list, records)]
    # Not _eager_build_scope: tf.init_scope pauses gradient tapes, so the backward would be skipped.
    with tf.device(device), _sandbox(layer_list):
        for _ in range(1 + warmup + repeats):  # the first call traces
            for step, x, times in steps:  # round-robin: a burst of load hits every layer alike
                start = time.perf_counter()
                step(x).numpy()
                times.append(time.perf_counter() - start)
    return [float(statistics.median(times[1 + warmup :])) for _, _, times in steps]


def _checked(costs: Sequence[float], num_stages: int) -> List[float]:
    if isinstance(num_stages, bool) or not hasattr(num_stages, "__index__"):
        raise ValueError(f"tf_gpipe: num_stages must be an integer >= 1, got {num_stages!r}.")
    values = [float(c) for c in costs]
    if not values:
        raise ValueError("tf_gpipe: costs is empty; give one cost per layer.")
    bad = [i for i, c in enumerate(values) if not (math.isfinite(c) and c >= 0)]
    if bad:
        raise ValueError(f"tf_gpipe: costs[{bad[0]}] = {values[bad[0]]!r}; costs must be finite and >= 0.")
    even_balance(len(values), operator.index(num_stages))  # raises unless 1 <= num_stages <= layers
    return values


def solve_minmax(costs: Sequence[float], num_stages: int) -> List[int]:
    """The contiguous partition whose most expensive stage is as cheap as possible (optimal).

    Under fill-drain the slowest stage sets the pace, so the step time follows
    the largest stage cost. Exact dynamic program, O(K n^2). Of the optimal
    partitions, the one with the least sum of squared stage costs; on exact ties,
    larger early stages (as :func:`~tf_gpipe.partition.even_balance`).

    Args:
        costs: one cost per layer, finite and >= 0.
        num_stages: K, 1 <= K <= len(costs); every stage gets at least one layer.

    Returns:
        Layers per stage, e.g. ``[3, 3, 2, 2]``.

    Example:
        >>> solve_minmax([1, 1, 1, 1, 4], 2)
        [4, 1]
    """
    c, k_all = _checked(costs, num_stages), operator.index(num_stages)
    prefix = np.concatenate([[0.0], np.cumsum(c)])
    bound, _ = _sweep(prefix, k_all, np.maximum)
    if bound == 0:  # nothing costs anything
        return even_balance(len(c), k_all)
    # Same sums again (the bound holds exactly): least sum of squares, scaled by an exact power of two.
    e = math.frexp(bound)[1]
    _, lengths = _sweep(prefix, k_all, lambda p, s: np.where(s <= bound, p + np.ldexp(s, -e) ** 2, np.inf))
    return lengths


def _sweep(prefix: np.ndarray, k_all: int, combine: Callable) -> Tuple[float, List[int]]:
    """``table[k, i]``: the best score of the first i layers in k stages; ``combine(table[k-1, j],
    cost of layers j..i-1)`` scores each last cut j. The least wins, on ties the last one."""
    n = len(prefix) - 1
    table = np.full((k_all + 1, n + 1), np.inf)
    table[0, 0] = 0.0
    start = np.zeros((k_all + 1, n + 1), dtype=int)
    for k in range(1, k_all + 1):
        for i in range(k, n - (k_all - k) + 1):
            j = np.arange(k - 1, i)
            total = combine(table[k - 1, j], prefix[i] - prefix[j])
            a = len(total) - 1 - int(np.argmin(total[::-1]))
            table[k, i], start[k, i] = total[a], j[a]
    ends = [n]
    for k in range(k_all, 1, -1):
        ends.insert(0, int(start[k, ends[0]]))
    return float(table[k_all, n]), [b - a for a, b in zip([0] + ends[:-1], ends)]


def _block_partition(costs: List[float], k: int, closest: bool) -> Optional[List[int]]:
    """Bárány et al.'s block partition, step for step as torchgpipe; None where that would fail."""
    n, seen = len(costs), set()
    low, span = min(costs), max(costs) - min(costs)
    unit = [0.0] * n if span == 0 else [(x - low) / span for x in costs]  # costs rescaled to [0, 1]
    ends = [n // k * (i + 1) for i in range(k - 1)] + [n]  # n // k layers a stage, the remainder last
    while True:
        sizes = [sum(unit[(ends[i - 1] if i else 0) : ends[i]]) for i in range(k)]
        largest = max(sizes)
        p = max(i for i, s in enumerate(sizes) if s == largest)  # torchgpipe's max((size, i))
        while True:
            sizes = [sum(unit[(ends[i - 1] if i else 0) : ends[i]]) for i in range(k)]
            if largest <= min(sizes) + 1:
                return [b - a for a, b in zip([0] + ends[:-1], ends)]
            ties = [i for i, s in enumerate(sizes) if s == min(sizes)]
            # torchgpipe takes the first cheapest stage; the paper the one closest to p.
            q = min(ties, key=lambda i: abs(i - p)) if closest else ties[0]
            h = q - 1 if p < q else q + 1
            state = (tuple(ends), p, largest)
            if ends[h] == (ends[h - 1] if h else 0) or state in seen:
                return None  # a layer from an empty stage, or a cycle: torchgpipe would go wrong
            seen.add(state)
            if p < q:
                ends[h] -= 1  # the last layer of stage h moves to stage q
            else:
                ends[q] += 1  # the first layer of stage h moves to stage q
            if p == h:
                break


def solve_min_variance(costs: Sequence[float], num_stages: int) -> List[int]:
    """torchgpipe's heuristic (Bárány et al., "Block partitions of sequences"): even, not optimal.

    Costs are rescaled to [0, 1]; from ``n // K`` layers a stage, a layer moves
    from a neighbour into the cheapest stage until the dearest exceeds it by at
    most one rescaled layer. The result is torchgpipe's, except where torchgpipe
    would take a layer from an empty stage (it then returns an empty stage or
    never stops): there the cheapest stage closest to the dearest is taken, as
    the paper says. :func:`solve_minmax` is optimal; this is for parity.

    Args:
        costs: one cost per layer, finite and >= 0.
        num_stages: K, 1 <= K <= len(costs).

    Returns:
        Layers per stage, every entry >= 1.

    Example:
        >>> solve_min_variance([1, 2, 3, 4, 5, 6], 2)  # as torchgpipe
        [4, 2]
    """
    c = _checked(costs, num_stages)
    for closest in (False, True):
        lengths = _block_partition(c, operator.index(num_stages), closest)
        if lengths is not None and min(lengths) > 0:
            return lengths
    return solve_minmax(c, num_stages)  # never seen; keeps every stage non-empty


def stage_costs(costs: Sequence[float], balance: Sequence[int]) -> List[float]:
    """The summed cost of each stage of ``balance`` (layers per stage)."""
    return [sum(group) for group in split_by_balance([float(c) for c in costs], None, balance)]


def balance_by(
    method: str, layers: Layers, num_stages: int, sample: Any = None, solver: str = "minmax", **kwargs: Any
) -> List[int]:
    """Layers per stage that even out one cost: ``"params"``, ``"time"`` or ``"memory"``.

    Args:
        method: the estimate to balance: :func:`by_params`, :func:`by_time` or :func:`by_memory`.
        layers, sample: as for :func:`by_params`.
        num_stages: K, the number of stages.
        solver: ``"minmax"`` (optimal largest stage) or ``"min_variance"`` (torchgpipe's).
        **kwargs: for the estimator (``repeats=``, ``optimizer_slots=``, ``batch_size=``...).

    Returns:
        The ``balance`` argument of :class:`~tf_gpipe.PipelineModel`.

    Example:
        >>> layers = [keras.layers.Dense(64) for _ in range(7)] + [keras.layers.Dense(10_000)]
        >>> balance_by("params", layers, 2, (32, 64))  # for PipelineModel(layers, balance=...)
        [7, 1]
    """
    estimators = {"params": by_params, "time": by_time, "memory": by_memory}
    solvers = {"minmax": solve_minmax, "min_variance": solve_min_variance}
    if method not in estimators:
        raise ValueError(f"tf_gpipe: unknown balance method {method!r}; use one of {list(METHODS)}.")
    if solver not in solvers:
        raise ValueError(f"tf_gpipe: unknown solver {solver!r}; use one of {list(SOLVERS)}.")
    layer_list, spec = _layer_list(layers)
    _checked([0.0] * len(layer_list), num_stages)  # fail before profiling
    costs = estimators[method](layer_list, spec if sample is None else sample, **kwargs)
    return solvers[solver](costs, num_stages)


def report(
    layers: Layers, balance: Sequence[int], sample: Any = None, *,
    time_costs: Optional[Sequence[float]] = None, devices: Optional[Sequence[str]] = None,
    num_micro_batches: int = 1, schedule: str = "gpipe", virtual_stages: int = 1, batch_size: int = 32,
) -> str:  # fmt: skip
    """A ``model.summary()``-like table of a partition, with its predicted bubble and imbalance.

    Per stage: device, parameters, time (sum of ``time_costs``), activations
    (outputs for ``sample``) and layer names. Then max/mean of the stage times
    (parameters without ``time_costs``) and, with them, the step time and bubble
    :meth:`~tf_gpipe.schedules.Schedule.simulate` predicts (each layer's time split
    1:2 into forward and backward) beside those of perfectly even stages.

    Args:
        layers, sample, batch_size: as for :func:`by_params`; unbuilt layers need ``sample``.
        balance: layers per stage (``num_stages * virtual_stages`` entries).
        time_costs: seconds per layer, e.g. from :func:`by_time`.
        devices: one per pipeline position; default: those PipelineModel would pick.
        num_micro_batches: M, for the predicted bubble.
        schedule, virtual_stages: as for PipelineModel; stage ``s`` runs on device ``s % K``.

    Returns:
        The report as one string.

    Example:
        >>> layers = [keras.layers.Dense(64) for _ in range(4)]
        >>> print(report(layers, [2, 2], (32, 64), time_costs=by_time(layers, (32, 64))))  # doctest: +SKIP
    """
    layer_list, spec = _layer_list(layers)
    groups = split_by_balance(list(range(len(layer_list))), None, balance)
    if len(groups) % virtual_stages:
        raise ValueError(f"tf_gpipe: balance has {len(groups)} stages, not a multiple of virtual_stages.")
    if time_costs is not None and len(time_costs) != len(layer_list):
        raise ValueError(f"tf_gpipe: time_costs has {len(time_costs)} entries for {len(layer_list)} layers.")
    known: Dict[str, Optional[List[float]]] = {"time": time_costs, "activations": None}
    if sample is not None or spec is not None or not all(layer.built for layer in layer_list):
        records = _prepare(layer_list, spec if sample is None else sample, batch_size)[1]
        known["activations"] = [_nbytes(y) for _, _, y in records]
    known["params"] = [layer.count_params() for layer in layer_list]
    per = {k: None if v is None else [float(sum(v[i] for i in g)) for g in groups] for k, v in known.items()}
    num_devices = len(groups) // virtual_stages
    devices = list(devices) if devices is not None else default_devices(num_devices)
    if len(devices) != num_devices:
        raise ValueError(f"tf_gpipe: got {len(devices)} devices for {num_devices}; give one per device.")
    headers = ["stage", "device", "params", "time (ms)", "activations (MiB)", "layers"]

    def cell(key: str, s: int, scale: float, pattern: str) -> str:
        return "-" if per[key] is None else format(per[key][s] * scale, pattern)

    rows = [headers] + [
        [str(s), devices[s % num_devices], cell("params", s, 1, ",.0f"), cell("time", s, 1e3, ".3f"),
         cell("activations", s, 2**-20, ".2f"), ", ".join(layer_list[i].name for i in g)]
        for s, g in enumerate(groups)
    ]  # fmt: skip
    widths = [max(len(r[c]) for r in rows) for c in range(5)]  # the names, last, are not padded
    table = ["  ".join([r[c].ljust(w) if c < 2 else r[c].rjust(w) for c, w in enumerate(widths)] + [r[5]])
             for r in rows]  # fmt: skip
    lines = [f"Pipeline partition: {len(layer_list)} layers, balance={list(balance)}, {num_devices} devices, "
             f"M={num_micro_batches}, schedule={schedule!r}", table[0], "-" * len(table[0]), *table[1:],
             f"Total params: {sum(known['params']):,}"]  # fmt: skip
    basis = "time" if time_costs is not None else "params"
    stage = per[basis]
    mean = sum(stage) / len(stage)
    lines.append(f"Stage imbalance (max/mean {basis}): " + (f"{max(stage) / mean:.2f}" if mean else "n/a"))
    plan = schedules.get(schedule, num_devices, num_micro_batches, virtual_stages)
    even = plan.bubble_fraction(1.0, 2.0)
    if time_costs is None or not mean:
        lines.append(f"Bubble with even stages: {even:.1%} (pass time_costs=by_time(...) to predict)")
    else:
        fwd, bwd = [t / 3 for t in stage], [2 * t / 3 for t in stage]
        step, ideal = plan.simulate(fwd, bwd).makespan, plan.simulate(mean / 3, 2 * mean / 3).makespan
        lines.append(f"Predicted step: {step * 1e3:.3f} ms, bubble {plan.bubble_fraction(fwd, bwd):.1%}; "
                     f"perfectly even stages: {ideal * 1e3:.3f} ms, bubble {even:.1%}")  # fmt: skip
    return "\n".join(lines)
