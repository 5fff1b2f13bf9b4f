"""Saving a PipelineModel: its config and build config, and an unsplit copy (Sequential or functional)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import keras
import tensorflow as tf
from keras import tree

from tf_gpipe import structure
from tf_gpipe.devices import resolve_devices

__all__: list[str] = []


# PipelineModel's argument (and attribute) for GPipe's loops over micro-batches. A config
# that carries it under one of its other names loads too: --tick_loop is the deprecated
# name of --micro_batch_loops (tf_gpipe.flags), and a file may come from either side of it.
_LOOPS_ARGUMENT = "micro_batch_loops"
_LOOPS_NAMES = ("micro_batch_loops", "tick_loop")


def get_build_config(model: Any) -> dict:
    """The input spec the model was built for: ``load_model`` rebuilds it before loading weights."""
    if model.build_spec is None:
        return {}
    return {
        "input_spec": tf.nest.map_structure(
            lambda t: None if t is None else {"shape": list(t.shape), "dtype": t.dtype},
            model.build_spec,
        )
    }


def build_from_config(model: Any, config: dict) -> None:
    """Build the stages for the saved input spec (nested inputs and their dtypes included)."""
    if "input_spec" in config and not model.built:

        def one(d):
            return keras.KerasTensor(tuple(d["shape"]), dtype=d["dtype"])

        spec = tree.traverse(
            lambda d: one(d) if isinstance(d, dict) and set(d) == {"shape", "dtype"} else None,
            config["input_spec"],
            top_down=True,
        )
        model.build_cells(spec)


def get_config(model: Any) -> dict:
    """The constructor arguments (or ``from_model``'s source graph and cut) as a Keras config."""
    config = {
        "name": model.name,
        "trainable": model.trainable,
        "num_micro_batches": model.num_micro_batches,
        "devices": model.devices_argument,
        "remat": model.remat,
        "schedule": model.schedule,
        "virtual_stages": model.virtual_stages,
        "deferred_batch_norm": model.deferred_batch_norm,
        "side_inputs": list(model.side_inputs),
        _LOOPS_ARGUMENT: getattr(model, _LOOPS_ARGUMENT),
    }
    if model.source_model is not None:  # from_model: the graph and where it was cut
        config["source_model"] = keras.saving.serialize_keras_object(model.source_model)
        config["node_balance"] = list(model.balance)  # nodes per stage (from_model)
        config["num_stages"] = model.num_stages
    else:
        config["layers"] = [keras.saving.serialize_keras_object(layer) for layer in model.stage_layers]
        config["balance"] = list(model.balance)
    return config


def from_config(cls: Any, config: dict, custom_objects: Any = None) -> Any:
    """A new ``cls`` (PipelineModel) from ``get_config``'s output."""
    # Keras' deserialization consumes nested configs in place: keep the caller's intact.
    config = copy.deepcopy(config)
    for name in _LOOPS_NAMES:
        if name != _LOOPS_ARGUMENT and name in config:
            config.setdefault(_LOOPS_ARGUMENT, config.pop(name))
    if "source_model" in config:
        source = keras.saving.deserialize_keras_object(
            config.pop("source_model"), custom_objects=custom_objects
        )
        return cls.from_model(source, balance=config.pop("node_balance"), **config)
    config["num_stages"] = len(config["balance"]) // config.get("virtual_stages", 1)
    layers = [
        keras.saving.deserialize_keras_object(c, custom_objects=custom_objects) for c in config.pop("layers")
    ]
    devices = config.get("devices")
    if devices is not None:
        try:
            resolve_devices(devices, len(devices))
        except ValueError as e:
            warnings.warn(
                f"tf_gpipe: the saved devices are not all available here ({e}); "
                "loading with the default devices instead.",
                stacklevel=3,  # the caller of PipelineModel.from_config
            )
            config["devices"] = None
    return cls(layers=layers, **config)


def to_sequential(model: Any, name: str | None = None) -> keras.Sequential:
    """An unsplit ``keras.Sequential`` copy of the layers, with the current weights.

    Train pipelined, serve unsplit: the copy has no device placement and no
    micro-batching, and its ``get_weights()`` equals the model's.
    """
    if not model.built:
        raise ValueError(not_built("to_sequential()"))
    if model.source_model is not None:  # GraphStages are views of a graph, not layers to copy
        raise ValueError(
            "tf_gpipe: this model was split from a functional model by from_model, so it has "
            "no layer list to put in a keras.Sequential; use model.to_functional() for an "
            "unsplit copy."
        )
    if model.side_inputs:
        raise ValueError(
            "tf_gpipe: a keras.Sequential cannot pass side inputs to its layers; export the "
            "weights with get_weights() into a functional model that wires them instead."
        )
    clones = [layer.__class__.from_config(layer.get_config()) for layer in model.stage_layers]
    spec = model.build_spec
    if isinstance(spec, keras.KerasTensor):  # keep the input dtype and a free batch size
        clones.insert(0, keras.Input(batch_shape=(None,) + tuple(spec.shape[1:]), dtype=spec.dtype))
    seq = keras.Sequential(clones, name=name or f"{model.name}_sequential")
    # Build the copy by running it once on zeros: a symbolic call cannot build
    # layers that take tuples or dicts (Concatenate, custom layers).
    seq(structure.zeros_like_spec(model.build_spec), training=False)
    seq.set_weights(model.get_weights())
    return seq


def to_functional(model: Any, name: str | None = None) -> keras.Model:
    """An unsplit functional copy of ``from_model``'s source model, with the current weights."""
    source = model.source_model
    if source is None:
        raise ValueError(
            "tf_gpipe: to_functional() exports a model made by PipelineModel.from_model; this "
            "one was built from a list of layers: use model.to_sequential()."
        )
    # clone_model copies each layer by its config onto the same graph: the copy's variables
    # are its own, in the source's order. The source shares this model's variables.
    clone = keras.models.clone_model(source)
    copy_ = keras.Model(clone.input, clone.output, name=name or f"{model.name}_functional")
    copy_.set_weights(source.get_weights())
    return copy_


def input_signature(model: Any) -> list[Any]:
    """``export``'s input signature: the inputs the model was built for (nested, with their
    dtypes), any batch size. Keras infers one for a subclassed model only from a
    ``build(shape)`` call, and as float32."""
    if model.build_spec is None:
        raise ValueError(not_built("export()"))
    return [
        tf.nest.map_structure(
            lambda t: None if t is None else tf.TensorSpec((None, *t.shape[1:]), t.dtype), model.build_spec
        )
    ]


def export_saved_model(model: Any, filepath: Any, verbose: Any, signature: Any, **kwargs: Any) -> None:
    """A SavedModel of the split model whose variables load on their stages' devices.

    TensorFlow saves no variable device by default and loads every variable on one device,
    while the serving function keeps each stage's ops on its device: a GPU stage could then
    not read its own weights (TensorFlow refuses a resource on another device)."""
    archive = keras.export.ExportArchive()
    archive.track_and_add_endpoint("serve", model, signature, **kwargs)
    policy = tf.saved_model.experimental.VariablePolicy.SAVE_VARIABLE_DEVICES
    options = tf.saved_model.SaveOptions(experimental_variable_policy=policy)
    archive.write_out(filepath, options=options, verbose=True if verbose is None else verbose)


def listed_weights(model: Any) -> list[Any]:
    """The variables ``get_weights()`` and ``set_weights()`` list, in order.

    After ``from_model``, the source model's order (Keras lists a functional model's weights
    layer by layer in its own order), so a weight list passes between the pipeline, its source,
    ``to_functional()`` and any clone of the source: stage by stage, a branching model's
    equal-shaped weights (two heads) would land on each other's layers without an error.
    Else the layers' order, as ``keras.Sequential(layers)``'s. Variables of the pipeline's
    own that the source does not list follow, in the pipeline's order.
    """
    own = model.weights
    if model.source_model is None:
        return own
    held = {id(v) for v in own}
    ordered = [v for v in model.source_model.weights if id(v) in held]
    listed = {id(v) for v in ordered}
    return ordered + [v for v in own if id(v) not in listed]


def set_weights(model: Any, weights: Any) -> None:
    """``set_weights()`` in ``listed_weights``' order, with Keras' checks."""
    if not model.built:  # Keras alone would say "expecting 0 weights"
        raise ValueError(not_built("set_weights()"))
    variables = listed_weights(model)
    if len(variables) != len(weights):
        raise ValueError(
            f"tf_gpipe: set_weights() got {len(weights)} arrays for the {len(variables)} weights "
            f"of {model.name!r}; pass one array per weight, in the order get_weights() lists them."
        )
    for variable, value in zip(variables, weights):
        if tuple(variable.shape) != tuple(getattr(value, "shape", ())):
            raise ValueError(
                f"tf_gpipe: set_weights() got an array of shape {getattr(value, 'shape', ())} for "
                f"the weight {variable.path!r} of shape {tuple(variable.shape)}; pass the arrays "
                "in the order get_weights() lists them."
            )
    for variable, value in zip(variables, weights):
        variable.assign(value)


def not_built(what: str) -> str:
    """The error for ``what`` on a PipelineModel that is not built yet."""
    return (
        f"tf_gpipe: build or call the model before {what}: its stages' weights do not exist "
        "yet. Build it with model.build((None, ...)) (the input shape), start its layers with "
        "keras.Input(shape=...), or call the model on a batch."
    )
