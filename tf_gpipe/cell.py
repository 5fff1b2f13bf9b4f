"""A cell: a run of consecutive Keras layers that lives and runs on one device."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import keras_compat, tf_compat
from tf_gpipe.batchnorm import batch_norm_layers

__all__: list[str] = []


@contextlib.contextmanager
def eager_build_scope(device: str) -> Iterator[None]:
    """Create variables eagerly on ``device``, even from inside a trace.

    Keras may first touch the model inside ``backend.compute_output_spec`` (a
    scratch graph under a StatelessScope). Variables made there are initialized
    later, outside any device scope, and land on the default device; building
    under ``tf.init_scope`` with no stateless scope puts them where they belong.
    """
    with keras_compat.suspend_stateless_scope(), tf.init_scope(), tf.device(device):
        yield


def _call_parameters(layer: keras.layers.Layer) -> set:
    try:
        return set(inspect.signature(layer.call).parameters)
    except (TypeError, ValueError):
        return set()


def layer_kwargs(
    layer: keras.layers.Layer, mask: Any, training: bool | None, side: dict | None = None
) -> dict:
    # The arguments keras.Sequential passes to each layer, plus any side input the
    # layer's call() names as a parameter.
    kwargs = {}
    if side:
        wanted = _call_parameters(layer)
        kwargs.update({k: v for k, v in side.items() if k in wanted})
    if keras_compat.call_takes_mask(layer):
        kwargs["mask"] = mask
    if keras_compat.call_takes_training(layer) and training is not None:
        kwargs["training"] = training
    return kwargs


def _several_inputs_hint(layer: Any, x: Any, error: Exception) -> str:
    """Where a layer that takes several tensors got the previous layer's one output, name
    from_model: a list of layers is a chain, so such a layer needs a functional model."""
    if tf.nest.is_nested(x):
        return ""
    required = [
        p
        for p in inspect.signature(layer.call).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(required) < 2 and "list" not in str(error).lower():
        return ""
    return (
        f". Each layer of a PipelineModel gets the previous layer's output, but {layer.name!r} "
        "takes several tensors: wire the layers into a functional keras.Model(inputs, outputs) "
        "and split it with tf_gpipe.PipelineModel.from_model(model, num_stages=...)."
    )


class Cell:
    """Consecutive layers placed on one device.

    Args:
        index: position of the cell in the pipeline (0 = first stage).
        layers: the Keras layers, applied in order as ``keras.Sequential`` does.
        device: canonical TensorFlow device string.
    """

    def __init__(self, index: int, layers: Sequence[keras.layers.Layer], device: str):
        self.index = index
        self.layers: list[keras.layers.Layer] = list(layers)
        self.device = device
        self.jit_compile = False  # compile this stage's functions with XLA (PipelineModel.compile)
        self.run_eagerly = False  # run its layers op by op (compile(run_eagerly=True))
        self._batch_norms: list | None = None
        # What other modules keep per stage, here so that it lives as long as the stage:
        # its traced functions (``tf_gpipe.stage``, one set per XLA choice), the variables
        # fit sums its gradients in (shared by those sets), and the ids of the variables
        # whose gradient rows do not grow with the batch (``tf_gpipe.sparse``).
        self.stage_functions: dict[tuple[bool, bool, bool, tuple[int, ...]], Any] = {}
        self.gradient_sums: dict[int, tf.Variable] = {}
        self.batch_free_rows: frozenset[int] | None = None
        self.copies: dict[int, tf.Variable] = {}  # ``copied``'s, by id(the weight)

    def copied(self) -> list[tuple[tf.Variable, tf.Variable]]:
        """``(weight, its copy on this cell's device)`` for each trainable weight of this cell
        that lives on another cell's device (a weight several cells share lives on the last
        that uses it): a training step reads the copy, made once a step
        (``engine.run_schedule``), not the weight once per micro-batch. The copies are
        made on first use, and are no weights of the model (not saved, not updated)."""
        target = tf.DeviceSpec.from_string(self.device)
        out = []
        for v in self.trainable_variables:
            raw = keras_compat.backing_variable(v)
            if not isinstance(raw, tf.Variable) or _on_device(raw.device, target):
                continue
            copy = self.copies.get(id(raw))
            if copy is None:
                name = raw.name.split(":")[0] + "_copy"
                with eager_build_scope(self.device):
                    copy = tf.Variable(raw.read_value(), trainable=False, name=name)
                self.copies[id(raw)] = copy
            out.append((raw, copy))
        return out

    @property
    def batch_norms(self) -> list:
        """The BatchNormalization layers of this cell, nested ones included."""
        if self._batch_norms is None:
            self._batch_norms = batch_norm_layers(self.layers)
        return self._batch_norms

    def __repr__(self) -> str:
        names = ", ".join(layer.name for layer in self.layers)
        return f"Cell({self.index}, device={self.device!r}, layers=[{names}])"

    @property
    def trainable_variables(self) -> list:
        out, seen = [], set()
        for layer in self.layers:
            for v in layer.trainable_variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def build(self, spec: Any, side: dict | None = None) -> Any:
        """Build every layer on this cell's device; return the output spec (KerasTensors)."""
        for layer in self.layers:
            _move_variables(layer, self.device)
        with eager_build_scope(self.device):
            x, mask = spec, None
            for layer in self.layers:
                try:
                    x = _symbolic_call(layer, x, layer_kwargs(layer, mask, None, side))
                except Exception as e:  # name the layer: the traceback alone is hard to read
                    raise type(e)(
                        f"tf_gpipe: building layer {layer.name!r} of stage {self.index} "
                        f"on inputs {x} failed: {e}{_several_inputs_hint(layer, x, e)}"
                    ) from e
                mask = tf.nest.map_structure(keras_compat.get_keras_mask, x)
                _move_variables(layer, self.device)
        return x

    def call(
        self, inputs: Any, mask: Any, training: bool | None, side: dict | None = None
    ) -> tuple[Any, Any]:
        """Apply the layers in order; return ``(outputs, mask)`` as keras.Sequential would.

        ``side`` maps side-input names to this micro-batch's tensors; a layer gets
        the ones its ``call`` has a parameter for.
        """
        x = inputs
        if mask is not None:
            attach_mask(x, mask)
        for layer in self.layers:
            x = layer(x, **layer_kwargs(layer, mask, training, side))
            mask = tf.nest.map_structure(keras_compat.get_keras_mask, x)
        if all(m is None for m in tf.nest.flatten(mask)):
            mask = None
        return x, mask


def _has_none(structure: Any) -> bool:
    return any(t is None for t in tf.nest.flatten(structure))


def _symbolic_call(layer: keras.layers.Layer, x: Any, kwargs: dict) -> Any:
    """``layer(x, **kwargs)`` on KerasTensors, as keras.Sequential builds a layer.

    Keras' symbolic call refuses a None among a layer's outputs (a functional graph
    node must output tensors), though an eager call passes it on (Lingvo's
    ``NestedMap(vec=..., paddings=None)``). Where the inputs hold a None, or the
    symbolic call fails and the outputs would hold one, the layer is traced in a
    ``tf.function`` instead (which also creates its variables): only the outputs'
    specs are kept, None leaves included.
    """
    if not _has_none((x, kwargs)):
        try:
            return layer(x, **kwargs)
        except ValueError as e:
            try:
                out = _traced_call(layer, x, kwargs)
            except Exception:
                raise e from None
            if not _has_none(out):
                raise
            return out
    return _traced_call(layer, x, kwargs)


def _traced_call(layer: keras.layers.Layer, x: Any, kwargs: dict) -> Any:
    def spec(t: Any) -> Any:
        if t is None or not hasattr(t, "shape"):
            return t
        return tf.TensorSpec(t.shape, t.dtype)

    def keras_tensor(t: Any) -> Any:
        if t is None or not tf.is_tensor(t):
            return t
        return keras.KerasTensor(tuple(t.shape), dtype=t.dtype.name, sparse=isinstance(t, tf.SparseTensor))

    got: dict = {}

    def run(inputs: Any, arguments: dict) -> list:
        with tf.name_scope("build"):  # a layer named like "_x" is no valid root scope
            out = layer(inputs, **arguments)
        masks = tf.nest.map_structure(lambda t: None if t is None else keras_compat.get_keras_mask(t), out)
        got["out"] = tf.nest.map_structure(keras_tensor, out)
        got["masks"] = tf.nest.map_structure(keras_tensor, masks)
        return [t for t in tf.nest.flatten(out) if t is not None]

    tf_compat.function(run, autograph=False).get_concrete_function(
        tf.nest.map_structure(spec, x), tf.nest.map_structure(spec, kwargs)
    )
    for t, m in zip(tf.nest.flatten(got["out"]), tf.nest.flatten(got["masks"])):
        if t is not None and m is not None:
            keras_compat.set_keras_mask(t, m)
    return got["out"]


def _on_device(current: str, target: tf.DeviceSpec) -> bool:
    spec = tf.DeviceSpec.from_string(current or "")
    for field in ("job", "replica", "task", "device_type", "device_index"):
        want = getattr(target, field)
        if want is not None and want != getattr(spec, field):
            return False
    return True


def _move_variables(layer: keras.layers.Layer, device: str) -> None:
    """Put every variable of ``layer`` on ``device``.

    Variables made before the layer joined a stage (a layer built in a
    ``keras.Sequential``, a Dropout's seed state made in its constructor, a
    layer built from a saved config) sit on the default device.
    """
    move_variables(layer.variables, device)


def move_variables(variables: Any, device: str) -> None:
    """Put each Keras variable of ``variables`` on ``device``.

    Keras variables wrap a ``tf.Variable``: swapping in a copy made on ``device``
    moves them for good, as long as no traced function has captured the old one.
    """
    target = tf.DeviceSpec.from_string(device)
    for v in variables:
        raw = keras_compat.backing_variable(v)
        if not isinstance(raw, tf.Variable) or _on_device(raw.device, target):
            continue
        with eager_build_scope(device):
            moved = tf.Variable(
                raw.read_value(),
                trainable=raw.trainable,
                name=raw.name.split(":")[0],
                aggregation=raw.aggregation,
                synchronization=raw.synchronization,
            )
        keras_compat.set_backing_variable(v, moved)


def attach_mask(x: Any, mask: Any) -> None:
    # Never swallow an error here: a stage would silently stop passing masks on.
    xs, ms = tf.nest.flatten(x), tf.nest.flatten(mask)
    if len(xs) == len(ms):
        for t, m in zip(xs, ms):
            if m is not None:
                keras_compat.set_keras_mask(t, m)
