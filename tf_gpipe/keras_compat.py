"""Every private Keras API tf_gpipe relies on, each behind one small named function.

Keras' public API covers most of what tf_gpipe does (``keras.tree``,
``keras.StatelessScope``, ``keras.utils.unpack_x_y_sample_weight``, ...). What it
cannot do without Keras internals lives here, one hook per function, each saying what
it uses and why. A Keras release that moves one of them fails in one place:
the hook raises ``KerasCompatError`` naming the Keras version and what is gone, and
its test in ``tests/test_keras_compat.py`` fails, rather than some equivalence test
far away, or worse, a silent wrong answer (a mask no longer passed, a variable left
on the wrong device). ``KerasCompatError`` is a ``RuntimeError``, never an
``AttributeError`` or ``ImportError``, so no ``except`` meant for user code can
swallow it.

Tested with Keras 3.15 and the 3.16 nightlies (``.ci/keras_nightly.sh``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import keras
import tensorflow as tf

__all__: list[str] = []


class KerasCompatError(RuntimeError):
    """The installed Keras lacks a private API tf_gpipe relies on."""


def _gone(what: str, why: str) -> KerasCompatError:
    return KerasCompatError(
        f"tf_gpipe: Keras {keras.__version__} no longer provides {what}, which tf_gpipe uses to "
        f"{why}. tf_gpipe is tested with Keras 3.15 (requirements.txt) and 3.16: install keras==3.15.1, or "
        "adapt this hook in tf_gpipe/keras_compat.py (tests/test_keras_compat.py checks each one)."
    )


def _attribute(obj: Any, name: str, why: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError as e:
        owner = obj.__name__ if isinstance(obj, (ModuleType, type)) else type(obj).__name__
        raise _gone(f"{owner}.{name}", why) from e


def _module(name: str, why: str) -> ModuleType:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise _gone(f"the module {name}", why) from e


# ------------------------------------------------------------------------------ masks
_MASKS = "pass Keras masks between stages, as keras.Sequential passes them between layers"


@functools.cache
def _masking() -> ModuleType:
    # Keras 3.15 re-exports these from keras.src.backend too; 3.16 no longer does.
    return _module("keras.src.backend.common.masking", _MASKS)


def get_keras_mask(x: Any) -> Any:
    """The Keras mask ``x`` carries, or None.

    Uses ``keras.src.backend.common.masking.get_keras_mask``: Keras keeps a mask as an
    attribute of the tensor and has no public reader; keras.Sequential reads it this way.
    """
    return _attribute(_masking(), "get_keras_mask", _MASKS)(x)


def set_keras_mask(x: Any, mask: Any) -> None:
    """Make ``x`` carry ``mask`` as its Keras mask (losses and metrics read it from ``y_pred``).

    Uses ``keras.src.backend.common.masking.set_keras_mask`` (no public writer).
    """
    _attribute(_masking(), "set_keras_mask", _MASKS)(x, mask)


# ------------------------------------------------------------------------------ layers
def call_takes_mask(layer: keras.layers.Layer) -> bool:
    """Whether keras.Sequential would pass ``mask=`` to ``layer`` (its ``call`` has the
    parameter). Uses ``Layer._call_has_mask_arg``, the flag keras.Sequential reads."""
    return bool(_attribute(layer, "_call_has_mask_arg", _MASKS))


def call_takes_training(layer: keras.layers.Layer) -> bool:
    """Whether keras.Sequential would pass ``training=`` to ``layer``.
    Uses ``Layer._call_has_training_arg``, the flag keras.Sequential itself reads."""
    why = "pass `training` to each layer as keras.Sequential does"
    return bool(_attribute(layer, "_call_has_training_arg", why))


def nested_layers(obj: Any) -> list[Any]:
    """``obj`` and every layer inside it (sublayers, nested models), ``obj`` first.

    A ``keras.Operation`` that is not a layer (an op node of a functional model) has no
    sublayers: ``[obj]``. Uses ``Layer._flatten_layers``: Keras has no public way to walk
    every nested layer (``Model.layers`` is one level deep).
    """
    if not isinstance(obj, keras.layers.Layer):
        return [obj]
    flatten = _attribute(obj, "_flatten_layers", "find nested BatchNormalization and tied layers")
    return list(flatten(include_self=True))


# ------------------------------------------------------------------------------ subclassing keras.Model
def overridable(base: type, name: str, why: str) -> None:
    """Fail unless ``base`` still has the private method ``name``, which a subclass
    overrides: were it renamed, the override would silently never run."""
    _attribute(base, name, why)


def first_call_argument(call_spec: Any) -> Any:
    """The inputs ``Layer.__call__`` builds for. ``PipelineModel`` overrides ``Layer._maybe_build``,
    run before ``call``, to build from their dtypes, not shapes. Uses ``CallSpec.first_arg``."""
    return _attribute(call_spec, "first_arg", "build a PipelineModel from its first inputs' dtypes")


def keep_input_dtypes(layer: keras.layers.Layer) -> None:
    """Let inputs reach ``layer.call`` as given, as in ``keras.Sequential``: no cast to its
    dtype policy, arrays accepted positionally. Sets ``Layer._convert_input_args`` and
    ``Layer._allow_non_tensor_positional_args``."""
    why = "pass inputs to the first stage in their own dtype"
    for name, value in (("_convert_input_args", False), ("_allow_non_tensor_positional_args", True)):
        _attribute(layer, name, why)
        setattr(layer, name, value)


def track_checkpoint_dependency(owner: keras.layers.Layer, layer: Any, name: str) -> None:
    """Make ``layer`` a ``tf.train.Checkpoint`` dependency of ``owner`` named ``name``, without
    an attribute (which would move the layer's weights in ``model.save``'s file). Uses
    ``Trackable._track_trackable`` (Keras layers are TensorFlow trackables)."""
    track = _attribute(owner, "_track_trackable", "save each stage's layers in a tf.train.Checkpoint")
    track(layer, name=name, overwrite=True)


# ------------------------------------------------------------------------------ variables
_PLACEMENT = "create each stage's variables on its own device"


def backing_variable(variable: Any) -> Any:
    """The ``tf.Variable`` behind a Keras variable (None before it is initialized).

    Uses ``Variable._value``: where a variable lives, and colocating optimizer slots with
    it, needs the backend variable, which Keras does not expose.
    """
    return _attribute(variable, "_value", _PLACEMENT)


def variable_device(variable: Any) -> str | None:
    """The device a Keras variable's ``tf.Variable`` (or a ``tf.Variable``) lives on; None
    before it exists. Uses ``backing_variable``."""
    raw = backing_variable(variable) if isinstance(variable, keras.Variable) else variable
    return getattr(raw, "device", None) or None


def set_backing_variable(variable: Any, value: Any) -> None:
    """Put ``value`` (a ``tf.Variable``) behind the Keras ``variable``: moves it to a device.
    Uses ``Variable._value``; nothing may have captured the old backing variable yet."""
    backing_variable(variable)  # the attribute must still exist: never create a stray one
    variable._value = value


# ------------------------------------------------------------------------------ optimizers
def colocate_optimizer_slots(optimizer: Any) -> None:
    """Make ``optimizer`` (and a ``LossScaleOptimizer``'s inner one) create each slot on its
    variable's device. Keras asks the distribution strategy to, which the default one
    ignores in a traced step (fit's first): every slot would land on device 0. Wraps
    ``add_variable_from_reference``, through which Keras optimizers make slots."""
    if optimizer is None or getattr(optimizer, "_tf_gpipe_colocated", False):
        return
    colocate_optimizer_slots(getattr(optimizer, "inner_optimizer", None))
    original = _attribute(
        optimizer, "add_variable_from_reference", "create optimizer slots on each stage's device"
    )

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(variable_device(reference_variable)):
            return original(reference_variable, *args, **kwargs)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer._tf_gpipe_colocated = True


def update_on_variable_device(optimizer: Any) -> None:
    """Make ``optimizer`` run each variable's ``update_step`` (slot arithmetic and
    assigns) under ``tf.device`` of the variable. Keras runs it inside the default
    strategy's ``extended.update``, which sets no device. Wraps the instance's
    ``update_step(gradient, variable, learning_rate)``, which every Keras optimizer
    implements and calls once per variable."""
    if optimizer is None or getattr(optimizer, "_tf_gpipe_update_placed", False):
        return
    original = _attribute(optimizer, "update_step", "run each variable's update on its device")

    def update_step(gradient, variable, learning_rate):
        with tf.device(variable_device(variable)):
            return original(gradient, variable, learning_rate)

    optimizer.update_step = update_step
    optimizer._tf_gpipe_update_placed = True


def skip_default_all_reduce(optimizer: Any) -> None:
    """Skip the default strategy's all-reduce of the gradients when no ``tf.distribute``
    strategy is active: an identity, made as one ``IdentityN`` over every gradient,
    which the placer puts on the default device, routing every stage's gradients there.
    Wraps ``TFOptimizer._all_reduce_sum_gradients``."""
    if optimizer is None or getattr(optimizer, "_tf_gpipe_no_default_all_reduce", False):
        return
    original = _attribute(optimizer, "_all_reduce_sum_gradients", "keep each gradient on its stage's device")

    def all_reduce_sum_gradients(grads_and_vars):
        if tf.distribute.has_strategy():
            return original(grads_and_vars)
        return list(grads_and_vars)

    optimizer._all_reduce_sum_gradients = all_reduce_sum_gradients
    optimizer._tf_gpipe_no_default_all_reduce = True


def optimizer_own_variables(optimizer: Any) -> list:
    """The optimizer's own scalar variables, not per-model-variable slots: its step count
    (``BaseOptimizer._iterations``), the learning rate when it is a variable
    (``BaseOptimizer._learning_rate``), and a
    ``LossScaleOptimizer``'s ``step_counter`` and ``dynamic_scale`` once built."""
    why = "keep the optimizer's own scalars on a stage's device"
    # Not ``iterations``: with gradient accumulation it is computed from ``_iterations``.
    own = []
    for name in ("_iterations", "_learning_rate"):
        v = _attribute(optimizer, name, why)
        if isinstance(v, keras.Variable):
            own.append(v)
    # A LossScaleOptimizer's (made in build), Nadam's running momentum product.
    for name in ("step_counter", "dynamic_scale", "_u_product"):
        v = getattr(optimizer, name, None)
        if isinstance(v, keras.Variable):
            own.append(v)
    return own


def factored_slots(optimizer: Any) -> list[tuple[Any, Any]]:
    """``[(slot, variable), ...]`` for the slots an optimizer makes without
    ``add_variable_from_reference``, so no hook sees which variable they belong to:
    Adafactor's row and column second moments (``_r``, ``_c``, one per variable, in
    the order of ``_trainable_variables``), made by its ``build``."""
    pairs = []
    for name in ("_r", "_c"):
        slots = getattr(optimizer, name, None)
        if isinstance(slots, list) and slots:
            why = "put Adafactor's factored moments beside their variables"
            variables = _attribute(optimizer, "_trainable_variables", why)
            pairs += list(zip(slots, variables))
    return pairs


# ------------------------------------------------------------------------------ stateless scope
@contextlib.contextmanager
def suspend_stateless_scope() -> Iterator[None]:
    """Leave any enclosing ``keras.StatelessScope`` for the duration of the block.

    Keras may first build the model inside ``backend.compute_output_spec`` (a scratch
    graph under a StatelessScope), where new variables would not be initialized. Uses the
    ``"stateless_scope"`` entry of ``keras.src.backend.common.global_state``, where Keras
    keeps the current scope; there is no public way to step out of one.
    """
    why = "build a stage's variables for real while Keras traces under a StatelessScope"
    state = _module("keras.src.backend.common.global_state", why)
    get = _attribute(state, "get_global_attribute", why)
    put = _attribute(state, "set_global_attribute", why)
    saved = get("stateless_scope")
    put("stateless_scope", None)
    try:
        yield
    finally:
        put("stateless_scope", saved)


def current_stateless_scope() -> keras.StatelessScope | None:
    """The innermost active ``keras.StatelessScope``, or None. Uses
    ``keras.src.backend.common.stateless_scope.get_stateless_scope`` (no public getter)."""
    why = "read a variable as the enclosing StatelessScope maps it"
    module = _module("keras.src.backend.common.stateless_scope", why)
    return _attribute(module, "get_stateless_scope", why)()


_REPLAY = "replay a stage's forward exactly when re-materializing it"


class RecordingScope(keras.StatelessScope):
    """A ``keras.StatelessScope`` that also remembers which variables were written (a
    Dropout's seed state, moving statistics): what a replay must restore. Overrides
    ``StatelessScope.add_update``, which every variable write in the scope calls."""

    def __init__(self, state_mapping: Any = None) -> None:
        overridable(keras.StatelessScope, "add_update", _REPLAY)
        super().__init__(state_mapping, collect_losses=True, initialize_variables=False)
        self.written: dict[int, Any] = {}

    def add_update(self, update: Any) -> None:
        self.written[id(update[0])] = update[0]
        super().add_update(update)


# ------------------------------------------------------------------------------ BatchNormalization
_DEFERRED = "defer BatchNormalization's moving statistics to one update per mini-batch"


def batch_norm_reduction_axes(bn: keras.layers.BatchNormalization) -> list[int]:
    """The axes a built BatchNormalization layer pools its moments over.
    Uses ``BatchNormalization._reduction_axes`` (set in ``build``)."""
    return list(_attribute(bn, "_reduction_axes", _DEFERRED))


@contextlib.contextmanager
def observe_batch_norm_moments(
    bn: keras.layers.BatchNormalization, observer: Callable[[Any, Any, Any, Any], None]
) -> Iterator[None]:
    """Call ``observer(inputs, mask, mean, variance)`` each time ``bn`` computes batch moments.

    Only a training call computes them. Uses ``BatchNormalization._moments(inputs, mask)``,
    wrapped for the duration of the block: the one place Keras computes them.
    """
    original = _attribute(bn, "_moments", _DEFERRED)

    def moments(inputs, mask):
        mean, variance = original(inputs, mask)
        observer(inputs, mask, mean, variance)
        return mean, variance

    bn._moments = moments
    try:
        yield
    finally:
        bn._moments = original


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
            raise _gone("Functional._nodes_by_depth", _GRAPH)
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
    return _attribute(_attribute(node, "arguments", _GRAPH), "fill_in", _GRAPH)(values)


def operation_caller(operation: Any, training: bool | None) -> Callable[..., Any]:
    """``operation`` as ``Functional.call`` runs it, with ``training`` passed explicitly.

    Keras 3.15 did this with ``keras.src.models.functional.operation_fn``; 3.16 removed it
    (nested calls take ``training`` from the call context). Passing it explicitly does the
    same on both, and also outside any call context (``graph.node_costs`` times nodes one
    by one). Uses ``Layer._call_context_args``: the call-context arguments a layer accepts.
    """
    if training is None or not isinstance(operation, keras.layers.Layer):
        return operation
    if "training" not in _attribute(operation, "_call_context_args", _GRAPH):
        return operation

    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs["training"] = training  # over the node's own, as Keras 3.15's operation_fn did
        return operation(*args, **kwargs)

    return call


def standardize_inputs(model: Any, inputs: Any) -> list:
    """``inputs`` as the flat list, in ``model.inputs`` order, that a functional model runs on.

    Uses ``Functional._standardize_inputs`` (dicts by input name, single tensors, nesting).
    """
    return _attribute(model, "_standardize_inputs", _GRAPH)(inputs)


def outputs_structure(model: Any) -> Any:
    """The nested structure of a functional model's outputs (``model.outputs`` is flat).

    Uses ``Function._outputs_struct``.
    """
    return _attribute(model, "_outputs_struct", _GRAPH)


def inputs_structure(model: Any) -> Any:
    """The nested structure of a functional model's inputs (``model.inputs`` is flat).

    Uses ``Function._inputs_struct``.
    """
    return _attribute(model, "_inputs_struct", _GRAPH)


# ------------------------------------------------------------------------------ training internals
def compiled_loss(model: keras.Model) -> Any:
    """The loss ``compile(loss=...)`` built, ``(y, y_pred, sample_weight) -> loss``, or None.

    Uses ``Trainer._compile_loss``: a custom train step computes the compiled loss per
    replica or micro-batch; ``compute_loss`` would also add the model's own losses.
    """
    return _attribute(model, "_compile_loss", "compute the compiled loss in a custom training step")


def loss_tracker(model: keras.Model) -> Any:
    """The ``Mean`` metric behind the ``loss`` that ``fit`` reports.

    Uses ``Trainer._loss_tracker``: a custom ``train_step`` must update it itself.
    """
    return _attribute(model, "_loss_tracker", "report the loss of a custom training step")


def set_initial_epoch(model: keras.Model, epoch: int | None) -> None:
    """Make the running ``fit`` start at ``epoch`` (None: from its own argument again).

    Uses ``Trainer._initial_epoch``, as ``keras.callbacks.BackupAndRestore`` does.
    """
    why = "resume fit from the epoch of a checkpoint (cluster.ResumableCheckpoint)"
    _attribute(model, "_initial_epoch", why)
    model._initial_epoch = epoch


def flat_compiled_losses(model: keras.Model) -> list:
    """The entries of the compiled loss, one per output (each with its ``.loss``), or [].

    Uses ``CompileLoss._flat_losses``: what reduction each output's loss uses decides
    whether a loss can be split over micro-batches.
    """
    loss = compiled_loss(model)
    if loss is None:
        return []
    return list(_attribute(loss, "_flat_losses", "check the reduction of each compiled loss") or [])


def model_compute_loss(
    model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any, training: bool = True
) -> Any:
    """``model.compute_loss(...)`` as Keras' own ``train_step`` calls it.

    Uses ``Trainer._compute_loss``, which also serves overrides of ``compute_loss`` written
    before it took ``training`` (Keras < 3.3).
    """
    method = _attribute(model, "_compute_loss", "compute the loss as keras.Model.train_step does")
    return method(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def aggregate_additional_loss(model: keras.Model, loss: Any) -> Any:
    """One scalar from a loss that layers added (``add_loss``, regularizers), as ``fit`` sums it.

    Uses ``Trainer._aggregate_additional_loss`` (a sum, cast to floatx if not float).
    """
    return _attribute(model, "_aggregate_additional_loss", "add the losses that layers add")(loss)


def clear_losses(model: keras.Model) -> None:
    """Forget the losses layers added in earlier calls (``__call__`` does it; a step that
    runs the layers without it must too). Uses ``Layer._clear_losses``."""
    _attribute(model, "_clear_losses", "clear the losses of an earlier call")()


def unscale_loss_for_distribution(loss: Any) -> Any:
    """The loss as ``fit`` reports it under a ``tf.distribute`` strategy (undone replica scaling).

    Uses ``keras.src.losses.loss.unscale_loss_for_distribution``.
    """
    why = "report the loss as keras.Model.train_step does"
    return _attribute(_module("keras.src.losses.loss", why), "unscale_loss_for_distribution", why)(loss)


def sequential_functional(model: keras.Sequential) -> Any:
    """The functional model behind a built ``keras.Sequential`` (None before it is built).

    Uses ``Sequential._functional``: its symbolic inputs and graph, which
    ``PipelineModel`` takes the input spec from and ``from_model`` cuts.
    """
    why = "read the input spec and graph of a built keras.Sequential"
    return _attribute(model, "_functional", why)  # set (to None) by Sequential.__init__
