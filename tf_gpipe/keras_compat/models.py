"""The hooks for models: the graph of a functional model, and the training internals a
custom ``train_step`` needs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import keras

from tf_gpipe.keras_compat.errors import gone, private_attribute, private_module

__all__: list[str] = []


# ------------------------------------------------------------------------------ functional models
_GRAPH = "cut a functional model into stages (PipelineModel.from_model)"


def _is_functional(model: Any) -> bool:
    return any(cls.__name__ == "Functional" for cls in type(model).__mro__)


def functional_nodes(model: Any) -> list | None:
    """The computation nodes of a functional model in the order Keras runs them, inputs excluded.

    None for a model without a graph (subclassed, or a Sequential not yet built). Uses
    ``Functional._nodes_by_depth`` and the nodes' ``operation``/``is_input``.
    """
    by_depth = getattr(model, "_nodes_by_depth", None)
    if by_depth is None:
        if _is_functional(model):
            raise gone("Functional._nodes_by_depth", _GRAPH)
        return None
    nodes = []
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if node.operation is not None and not node.is_input:
                nodes.append(node)
    return nodes


def node_arguments(node: Any, values: dict[int, Any]) -> tuple:
    """``(args, kwargs)`` of ``node``'s call, its symbolic inputs replaced by ``values[id(x)]``.

    Uses ``Node.arguments.fill_in``, as ``Functional.call`` does.
    """
    return private_attribute(private_attribute(node, "arguments", _GRAPH), "fill_in", _GRAPH)(values)


def operation_caller(operation: Any, training: bool | None) -> Callable[..., Any]:
    """``operation`` as ``Functional.call`` runs it, with ``training`` passed explicitly.

    Keras 3.15 did this with ``keras.src.models.functional.operation_fn``; 3.16 removed it
    (nested calls take ``training`` from the call context). Passing it explicitly does the
    same on both, and also outside any call context (``graph.node_costs`` times nodes one
    by one). Uses ``Layer._call_context_args``: the call-context arguments a layer accepts.
    """
    if training is None or not isinstance(operation, keras.layers.Layer):
        return operation
    if "training" not in private_attribute(operation, "_call_context_args", _GRAPH):
        return operation

    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs["training"] = training  # over the node's own, as Keras 3.15's operation_fn did
        return operation(*args, **kwargs)

    return call


def standardize_inputs(model: Any, inputs: Any) -> list:
    """``inputs`` as the flat list, in ``model.inputs`` order, that a functional model runs on.

    Uses ``Functional._standardize_inputs`` (dicts by input name, single tensors, nesting).
    """
    return private_attribute(model, "_standardize_inputs", _GRAPH)(inputs)


def outputs_structure(model: Any) -> Any:
    """The nested structure of a functional model's outputs (``model.outputs`` is flat).

    Uses ``Function._outputs_struct``.
    """
    return private_attribute(model, "_outputs_struct", _GRAPH)


def inputs_structure(model: Any) -> Any:
    """The nested structure of a functional model's inputs (``model.inputs`` is flat).

    Uses ``Function._inputs_struct``.
    """
    return private_attribute(model, "_inputs_struct", _GRAPH)


# ------------------------------------------------------------------------------ training internals
def compiled_loss(model: keras.Model) -> Any:
    """The loss ``compile(loss=...)`` built, ``(y, y_pred, sample_weight) -> loss``, or None.

    Uses ``Trainer._compile_loss``: a custom train step computes the compiled loss per
    replica or micro-batch; ``compute_loss`` would also add the model's own losses.
    """
    return private_attribute(model, "_compile_loss", "compute the compiled loss in a custom training step")


def loss_tracker(model: keras.Model) -> Any:
    """The ``Mean`` metric behind the ``loss`` that ``fit`` reports.

    Uses ``Trainer._loss_tracker``: a custom ``train_step`` must update it itself.
    """
    return private_attribute(model, "_loss_tracker", "report the loss of a custom training step")


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """Make the running ``fit`` start at ``epoch`` (None: from its own argument again).

    Uses ``Trainer._initial_epoch``, as ``keras.callbacks.BackupAndRestore`` does.
    """
    why = "resume fit from the epoch of a checkpoint (cluster.ResumableCheckpoint)"
    private_attribute(model, "_initial_epoch", why)
    model._initial_epoch = epoch


def flat_compiled_losses(model: keras.Model) -> list:
    """The entries of the compiled loss, one per output (each with its ``.loss``), or [].

    Uses ``CompileLoss._flat_losses``: what reduction each output's loss uses decides
    whether a loss can be split over micro-batches.
    """
    loss = compiled_loss(model)
    if loss is None:
        return []
    return list(private_attribute(loss, "_flat_losses", "check the reduction of each compiled loss") or [])


def loss_code(loss: Any) -> Any:
    """The code a compiled loss runs: the function a ``LossFunctionWrapper`` wraps (a
    function given to ``compile``, or one of Keras' own), else the ``Loss``'s class.

    Whose code it is (Keras', or the user's) decides whether a loss split over
    micro-batches is checked against the whole mini-batch. Uses
    ``keras.src.losses.losses.LossFunctionWrapper`` and its ``fn``.
    """
    why = "tell a loss function given to compile() from Keras' own"
    wrapper = private_attribute(private_module("keras.src.losses.losses", why), "LossFunctionWrapper", why)
    return private_attribute(loss, "fn", why) if isinstance(loss, wrapper) else type(loss)


def compiled_loss_metrics(model: keras.Model) -> list | None:
    """The metrics the compiled loss updates each time it is called (Keras keeps a loss
    ``Mean`` per output of a model with several), or None before its first call builds it.

    A step that calls the loss once per micro-batch leaves those updates to one call on the
    whole mini-batch, as Keras' own step makes them. Uses ``CompileLoss.built`` and
    ``CompileLoss.metrics``.
    """
    loss = compiled_loss(model)
    if loss is None:
        return []
    if not private_attribute(loss, "built", "find the metrics the compiled loss updates"):
        return None
    return list(private_attribute(loss, "metrics", "find the metrics the compiled loss updates"))


def model_compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool = True
) -> Any:
    """``model.compute_loss(...)`` as Keras' own ``train_step`` calls it.

    Uses ``Trainer._compute_loss``, which also serves overrides of ``compute_loss`` written
    before it took ``training`` (Keras < 3.3).
    """
    method = private_attribute(model, "_compute_loss", "compute the loss as keras.Model.train_step does")
    return method(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def aggregate_additional_loss(model: keras.Model, loss: Any) -> Any:
    """One scalar from a loss that layers added (``add_loss``, regularizers), as ``fit`` sums it.

    Uses ``Trainer._aggregate_additional_loss`` (a sum, cast to floatx if not float).
    """
    return private_attribute(model, "_aggregate_additional_loss", "add the losses that layers add")(loss)


@contextlib.contextmanager
def losses_listed(model: keras.Model, losses: list[Any]) -> Iterator[None]:
    """Within the scope ``model.losses`` returns ``losses`` instead of computing them, as
    ``compute_loss`` reads them. Uses ``Layer._losses_override``, which Keras' JAX trainer
    sets for its stateless calls; ``model.losses`` lists the losses layers added, then one
    ``regularizer(weight)`` per trainable weight with a regularizer, computed when read."""
    saved = private_attribute(model, "_losses_override", "compute each weight's regularization on its device")
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._losses_override = saved


def clear_losses(model: keras.Model) -> None:
    """Forget the losses layers added in earlier calls (``__call__`` does it; a step that
    runs the layers without it must too). Uses ``Layer._clear_losses``."""
    private_attribute(model, "_clear_losses", "clear the losses of an earlier call")()


def unscale_loss_for_distribution(loss: Any) -> Any:
    """The loss as ``fit`` reports it under a ``tf.distribute`` strategy (undone replica scaling).

    Uses ``keras.src.losses.loss.unscale_loss_for_distribution``.
    """
    why = "report the loss as keras.Model.train_step does"
    return private_attribute(
        private_module("keras.src.losses.loss", why), "unscale_loss_for_distribution", why
    )(loss)


def data_spec(iterator: Any, data_batch: Any) -> Any:
    """What ``Trainer._maybe_symbolic_build(iterator=None, data_batch=None)`` (which
    ``PipelineModel`` overrides) is given, as the spec of one batch, read before Keras traces
    its step: ``data_batch`` itself (``train_on_batch``), or the element spec of the epoch
    iterator's dataset (``fit``, ``evaluate``; nothing is consumed). Uses
    ``TFEpochIterator._distributed_dataset``. None where neither says."""
    if data_batch is not None:
        return data_batch
    if iterator is None:
        return None
    why = "build a PipelineModel before Keras traces its first step"
    return private_attribute(iterator, "_distributed_dataset", why).element_spec


def sequential_functional(model: keras.Sequential) -> Any:
    """The functional model behind a built ``keras.Sequential`` (None before it is built).

    Uses ``Sequential._functional``: its symbolic inputs and graph, which
    ``PipelineModel`` takes the input spec from and ``from_model`` cuts.
    """
    why = "read the input spec and graph of a built keras.Sequential"
    return private_attribute(model, "_functional", why)  # set (to None) by Sequential.__init__


# --------------------------------------------------- metric updates, recorded to replay
_recording = threading.local()
_patch_lock = threading.Lock()
_patched: dict[type, Any] = {}
_patch_depth = [0]


def _metric_classes() -> list[type]:
    found, stack = [], [keras.metrics.Metric]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return [c for c in found if "update_state" in vars(c)]


def _recorder(original: Any) -> Any:
    @functools.wraps(original)
    def update_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = getattr(_recording, "calls", None)
        if calls is None:
            return original(self, *args, **kwargs)
        calls.append((self, args, kwargs))
        return None

    return update_state


@contextlib.contextmanager
def recorded_metric_updates() -> Iterator[list[tuple[Any, tuple, dict]]]:
    """Within this scope, in this thread, a Keras metric's ``update_state(*args, **kwargs)``
    updates nothing: the call is added, as ``(metric, args, kwargs)``, to the list this
    yields, for the caller to make later.

    A loop over micro-batches runs each micro-batch's loss in its body, where the updates
    Keras makes inside a loss (a loss ``Mean`` per output, a ``compute_loss`` override's
    trackers) would be pruned, or race each other (``assign_add`` is a read and a write);
    the loop hands their arguments out instead, and the step makes the calls after it, in
    micro-batch order. Replaces ``update_state`` on every ``keras.metrics.Metric`` class that
    defines one, while any thread is in this scope.
    """
    calls: list[tuple[Any, tuple, dict]] = []
    with _patch_lock:
        if _patch_depth[0] == 0:
            for cls in _metric_classes():
                _patched[cls] = vars(cls)["update_state"]
                cls.update_state = _recorder(_patched[cls])  # type: ignore[attr-defined]
        _patch_depth[0] += 1
    previous = getattr(_recording, "calls", None)
    _recording.calls = calls
    try:
        yield calls
    finally:
        _recording.calls = previous
        with _patch_lock:
            _patch_depth[0] -= 1
            if _patch_depth[0] == 0:
                for cls, original in _patched.items():
                    cls.update_state = original  # type: ignore[attr-defined]
                _patched.clear()
