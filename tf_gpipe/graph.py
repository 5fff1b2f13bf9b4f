"""Split a functional Keras model into consecutive stages, carrying skip connections."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from tf_gpipe import keras_compat, structure, tf_compat
from tf_gpipe.balance import solve_minmax
from tf_gpipe.balance.profile import median_times, sandbox
from tf_gpipe.partition import check_stages, cuts_keeping, default_balance, split_by_balance, tied, within

__all__: list[str] = []


def graph_nodes(model: keras.Model) -> list:
    """The model's computation nodes in the order Keras runs them (inputs excluded)."""
    nodes = keras_compat.functional_nodes(model)
    if nodes is None:
        raise TypeError(
            f"tf_gpipe: from_model needs a functional Keras model (keras.Model(inputs, outputs)) "
            f"or a keras.Sequential; got {type(model).__name__}. Subclassed models have no graph "
            "to cut: pass their layers as a list to PipelineModel instead."
        )
    return nodes


class Cut(NamedTuple):
    """Where ``cut_model`` cut a model: what ``PipelineModel.from_model`` builds on."""

    stages: list  # one GraphStage per cell
    num_stages: int
    node_balance: list[int]  # nodes (layer calls) per cell
    spec: Any  # the model's input spec, as its inputs are nested
    source: keras.Model  # the functional model cut (a Sequential's functional twin)


def serve_split(models: Sequence[keras.Model], devices: Sequence[str]) -> None:
    """Let a model that was cut keep serving: its layers' variables now live on the stages'
    ``devices``."""
    for source in {id(m): m for m in models}.values():
        # Functions Keras traced before read the variables the cells replaced.
        source.train_function = source.test_function = source.predict_function = None
        if len(set(devices)) > 1:
            # One XLA program reads every variable on its own device: over several
            # devices the model serves without XLA (which Keras' "auto" picks on a GPU),
            # compiled again too (a model that does not support XLA compiles without).
            source.supports_jit = False
            source.jit_compile = False


def cut_model(
    model: keras.Model,
    num_stages: int | None,
    balance: Sequence[int] | str | None,
    virtual_stages: int,
) -> Cut:
    """``PipelineModel.from_model``'s split: the nodes cut into ``num_stages * virtual_stages`` stages."""
    if isinstance(model, keras.Sequential):
        functional = keras_compat.sequential_functional(model)
        if functional is None:  # no input shape yet: no graph to cut
            raise ValueError(
                f"tf_gpipe: from_model got the keras.Sequential {model.name!r}, which is not built, "
                "so it has no graph to cut yet. Give it an input shape first: start its layers "
                "with keras.Input(shape=...), or call model.build((None, ...)) (or the model on "
                "data); or pass its layers to PipelineModel(model.layers, ...) directly."
            )
        model = functional
    nodes = graph_nodes(model)
    if num_stages is None:  # as PipelineModel: one stage per balance entry, else 1
        listed = balance is not None and not isinstance(balance, str)
        num_stages = len(list(balance)) // virtual_stages if listed else 1  # type: ignore[arg-type]
    cells = num_stages * virtual_stages
    node_balance: list[int]
    operations = [node.operation for node in nodes]
    if balance is None:
        node_balance = default_balance(operations, cells)
    elif isinstance(balance, str):  # "params" | "time" | "memory", per graph node
        # A shared layer's uses in one stage where that many stages allow it.
        cuts = within(cuts_keeping(len(operations), tied(operations)), cells)
        node_balance = solve_minmax(node_costs(model, balance), cells, cuts)
    else:
        node_balance = [len(g) for g in split_by_balance(nodes, cells, balance)]
    stages = split_graph(model, node_balance, name=f"{model.name}_stage")
    return Cut(stages, num_stages, list(node_balance), structure.spec_from(input_spec(model)), model)


class GraphStage(keras.layers.Layer):
    """Consecutive nodes of a functional model, run as one layer.

    A middle stage takes and returns a dict of the tensors alive at its cuts
    (keys ``"t<n>"``): what later stages or the model's outputs still need,
    skip connections included, so a tensor that skips stages is carried
    through them. The first stage takes the model's own inputs; the last
    returns the model's outputs.
    """

    def __init__(
        self,
        source: keras.Model,
        nodes: Sequence[Any],
        in_keys: dict[str, int],
        out_keys: dict[str, int],
        first: bool,
        last: bool,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self._source = lambda: source  # a callable: Keras must not track the whole model here
        self._nodes = list(nodes)
        self._in_keys, self._out_keys = dict(in_keys), dict(out_keys)
        self._first, self._last = first, last
        ops, seen = [], set()
        for node in self._nodes:
            if id(node.operation) not in seen:
                seen.add(id(node.operation))
                ops.append(node.operation)
        self.stage_ops = ops  # tracked: this stage owns these layers' weights
        self.built = True
        # Its nodes read and set masks on the tensors themselves, as in the source model; left
        # False, Keras would warn that a masked input's mask is destroyed, which it is not.
        self.supports_masking = True

    def compute_mask(self, inputs: Any, mask: Any = None) -> None:
        return None  # the outputs carry the masks their nodes set

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        source = self._source()
        if self._first:
            flat = keras_compat.standardize_inputs(source, inputs)
            values = {id(x): y for x, y in zip(source.inputs, flat)}
        else:
            values = {self._in_keys[k]: v for k, v in inputs.items()}
        for node in self._nodes:
            args, kwargs = keras_compat.node_arguments(node, values)
            outputs = keras_compat.operation_caller(node.operation, training)(*args, **kwargs)
            for x, y in zip(node.outputs, tree.flatten(outputs)):
                values[id(x)] = y
        if self._last:
            outs = [values[id(x)] for x in source.outputs]
            packed = tree.pack_sequence_as(keras_compat.outputs_structure(source), outs)
            return packed[0] if isinstance(packed, list) and len(packed) == 1 else packed
        return {k: values[i] for k, i in self._out_keys.items()}


def split_graph(model: keras.Model, balance: Sequence[int], name: str = "stage") -> list[GraphStage]:
    """Cut ``model``'s nodes into ``len(balance)`` consecutive stages of ``balance[i]`` nodes."""
    nodes = graph_nodes(model)
    if sum(balance) != len(nodes):
        raise ValueError(
            f"tf_gpipe: balance={list(balance)} sums to {sum(balance)} but the model has "
            f"{len(nodes)} nodes to split."
        )
    groups, start = [], 0
    for size in balance:
        groups.append(nodes[start : start + size])
        start += size
    check_stages([[node.operation for node in group] for group in groups])
    # Which tensor each cut must carry: produced before it, used at or after it.
    produced_before: list[set] = []
    seen = {id(x) for x in model.inputs}
    for group in groups:
        produced_before.append(set(seen))
        for node in group:
            seen.update(id(x) for x in node.outputs)
    needed_from: list[set] = [set() for _ in groups]
    later = {id(x) for x in model.outputs}
    for k in range(len(groups) - 1, -1, -1):
        for node in groups[k]:
            later.update(id(x) for x in node.input_tensors)
        needed_from[k] = set(later)
    index: dict[int, int] = {}

    def keys(ids):
        for i in sorted(ids, key=lambda t: index.setdefault(t, len(index))):
            index.setdefault(i, len(index))
        return {f"t{index[i]:04d}": i for i in ids}

    stages = []
    for k, group in enumerate(groups):
        carried_in = produced_before[k] & needed_from[k]
        carried_out = (produced_before[k + 1] & needed_from[k + 1]) if k + 1 < len(groups) else set()
        stages.append(
            GraphStage(
                model,
                group,
                keys(carried_in),
                keys(carried_out),
                first=k == 0,
                last=k == len(groups) - 1,
                name=f"{name}_{k}",
            )
        )
    return stages


def node_stages(model: keras.Model) -> list[GraphStage]:
    """Each node of the functional ``model`` as a stage of its own: what ``tf_gpipe.plan``
    profiles, so that a balance over them is one ``from_model`` cuts by."""
    return split_graph(model, [1] * len(graph_nodes(model)), name=f"{model.name}_node")


def input_spec(model: keras.Model) -> Any:
    """The model's inputs, nested as it takes them."""
    return tree.pack_sequence_as(keras_compat.inputs_structure(model), model.inputs)


def node_costs(model: keras.Model, method: str, batch_size: int = 32, repeats: int = 5) -> list[float]:
    """A cost per node of ``graph_nodes(model)`` for balancing ``from_model`` stages.

    ``"params"``: parameter count (a layer used twice counts once). ``"memory"``:
    parameter bytes with two optimizer slots, plus the bytes of the node's outputs
    for ``batch_size`` examples. ``"time"``: the node's forward and backward on a
    zero batch of ``batch_size``, median of ``repeats`` calls (BatchNorm statistics
    and dropout seeds are put back after).
    """
    nodes = graph_nodes(model)
    seen: set = set()
    params = []
    for node in nodes:
        op = node.operation
        params.append(0 if id(op) in seen else op.count_params())
        seen.add(id(op))
    if method == "params":
        return [1.0 + p for p in params]
    if method == "memory":
        costs = []
        for node, p in zip(nodes, params):
            out = 0
            for t in node.outputs:
                shape = [batch_size if d is None else d for d in t.shape]
                out += int(np.prod(shape)) * np.dtype(t.dtype).itemsize
            costs.append(float(3 * 4 * p + out))
        return costs
    if method != "time":
        raise ValueError(
            f"tf_gpipe: from_model balances by 'params', 'memory', 'time' or a list, got {method!r}."
        )
    values = {}
    for x in model.inputs:
        shape = [batch_size if d is None else d for d in x.shape]
        values[id(x)] = tf.zeros(shape, dtype=x.dtype)
    steps = []
    ops = [n.operation for n in nodes if isinstance(n.operation, keras.layers.Layer)]
    with sandbox(ops):
        for node in nodes:
            args, kwargs = keras_compat.node_arguments(node, values)
            call = keras_compat.operation_caller(node.operation, True)
            outputs = call(*args, **kwargs)
            for x, y in zip(node.outputs, tree.flatten(outputs)):
                values[id(x)] = y

            def step(args=args, kwargs=kwargs, call=call, op=node.operation):
                flat = [t for t in tree.flatten((args, kwargs)) if tf.is_tensor(t) and t.dtype.is_floating]
                with tf.GradientTape() as tape:
                    tape.watch(flat)
                    outs = [t for t in tree.flatten(call(*args, **kwargs)) if t.dtype.is_floating]
                    loss = tf.add_n(
                        [tf.reduce_sum(tf.cast(t, tf.float32)) for t in outs] or [tf.constant(0.0)]
                    )
                grads = tape.gradient(loss, flat + list(getattr(op, "trainable_variables", [])))
                return tf.add_n(
                    [loss] + [tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads if g is not None]
                )

            steps.append(tf_compat.function(step, autograph=False))
        return median_times(steps, warmup=1, repeats=repeats)
