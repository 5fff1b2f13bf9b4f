"""The hooks for layers: masks, what ``call`` takes, subclassing ``keras.Model``, the
stateless scope that replays a stage's forward, BatchNormalization's moments.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import keras

from tf_gpipe.keras_compat.errors import private_attribute, private_module

__all__: list[str] = []


# ------------------------------------------------------------------------------ masks
_MASKS = "pass Keras masks between stages, as keras.Sequential passes them between layers"


@functools.cache
def _masking() -> ModuleType:
    # Keras 3.15 re-exports these from keras.src.backend too; 3.16 no longer does.
    return private_module("keras.src.backend.common.masking", _MASKS)


def get_keras_mask(x: Any) -> Any:
    """The Keras mask ``x`` carries, or None.

    Uses ``keras.src.backend.common.masking.get_keras_mask``: Keras keeps a mask as an
    attribute of the tensor and has no public reader; keras.Sequential reads it this way.
    """
    return private_attribute(_masking(), "get_keras_mask", _MASKS)(x)


def set_keras_mask(x: Any, mask: Any) -> None:
    """Make ``x`` carry ``mask`` as its Keras mask (losses and metrics read it from ``y_pred``).

    Uses ``keras.src.backend.common.masking.set_keras_mask`` (no public writer).
    """
    private_attribute(_masking(), "set_keras_mask", _MASKS)(x, mask)


# ------------------------------------------------------------------------------ layers
def call_takes_mask(layer: keras.layers.Layer) -> bool:
    """Whether keras.Sequential would pass ``mask=`` to ``layer`` (its ``call`` has the
    parameter). Uses ``Layer._call_has_mask_arg``, the flag keras.Sequential reads."""
    return bool(private_attribute(layer, "_call_has_mask_arg", _MASKS))


def call_takes_training(layer: keras.layers.Layer) -> bool:
    """Whether keras.Sequential would pass ``training=`` to ``layer``.
    Uses ``Layer._call_has_training_arg``, the flag keras.Sequential itself reads."""
    why = "pass `training` to each layer as keras.Sequential does"
    return bool(private_attribute(layer, "_call_has_training_arg", why))


def nested_layers(obj: Any, recursive: bool = True) -> list[Any]:
    """``obj`` and every layer inside it (sublayers, nested models), ``obj`` first; with
    ``recursive=False``, ``obj`` and the layers it holds itself.

    A ``keras.Operation`` that is not a layer (an op node of a functional model) has no
    sublayers: ``[obj]``. Uses ``Layer._flatten_layers``: Keras has no public way to walk
    every nested layer (``Model.layers`` is one level deep).
    """
    if not isinstance(obj, keras.layers.Layer):
        return [obj]
    flatten = private_attribute(obj, "_flatten_layers", "find nested BatchNormalization and tied layers")
    return list(flatten(include_self=True, recursive=recursive))


# ------------------------------------------------------------------------------ subclassing keras.Model
def overridable(base: type, name: str, why: str) -> None:
    """Fail unless ``base`` still has the private method ``name``, which a subclass
    overrides: were it renamed, the override would silently never run."""
    private_attribute(base, name, why)


def first_call_argument(call_spec: Any) -> Any:
    """The inputs ``Layer.__call__`` builds for. ``PipelineModel`` overrides ``Layer._maybe_build``,
    run before ``call``, to build from their dtypes, not shapes. Uses ``CallSpec.first_arg``."""
    return private_attribute(call_spec, "first_arg", "build a PipelineModel from its first inputs' dtypes")


def keep_input_dtypes(layer: keras.layers.Layer) -> None:
    """Let inputs reach ``layer.call`` as given, as in ``keras.Sequential``: no cast to its
    dtype policy, arrays accepted positionally. Sets ``Layer._convert_input_args`` and
    ``Layer._allow_non_tensor_positional_args``."""
    why = "pass inputs to the first stage in their own dtype"
    for name, value in (("_convert_input_args", False), ("_allow_non_tensor_positional_args", True)):
        private_attribute(layer, name, why)
        setattr(layer, name, value)


def track_checkpoint_dependency(owner: keras.layers.Layer, layer: Any, name: str) -> None:
    """Make ``layer`` a ``tf.train.Checkpoint`` dependency of ``owner`` named ``name``, without
    an attribute (which would move the layer's weights in ``model.save``'s file). Uses
    ``Trackable._track_trackable`` (Keras layers are TensorFlow trackables)."""
    track = private_attribute(owner, "_track_trackable", "save each stage's layers in a tf.train.Checkpoint")
    track(layer, name=name, overwrite=True)


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
    state = private_module("keras.src.backend.common.global_state", why)
    get = private_attribute(state, "get_global_attribute", why)
    put = private_attribute(state, "set_global_attribute", why)
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
    module = private_module("keras.src.backend.common.stateless_scope", why)
    return private_attribute(module, "get_stateless_scope", why)()


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
    return list(private_attribute(bn, "_reduction_axes", _DEFERRED))


@contextlib.contextmanager
def observe_batch_norm_moments(
    bn: keras.layers.BatchNormalization, observer: Callable[[Any, Any, Any, Any], None]
) -> Iterator[None]:
    """Call ``observer(inputs, mask, mean, variance)`` each time ``bn`` computes batch moments.

    Only a training call computes them. Uses ``BatchNormalization._moments(inputs, mask)``,
    wrapped for the duration of the block: the one place Keras computes them.
    """
    original = private_attribute(bn, "_moments", _DEFERRED)

    def moments(inputs, mask):
        mean, variance = original(inputs, mask)
        observer(inputs, mask, mean, variance)
        return mean, variance

    bn._moments = moments
    try:
        yield
    finally:
        bn._moments = original
