"""Helpers for nested structures of tensors: conversion, specs, batch size."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

__all__: list[str] = []


def is_float(t: Any) -> bool:
    return t is not None and tf.as_dtype(t.dtype).is_floating


def to_tensors(structure: Any) -> Any:
    return tf.nest.map_structure(
        lambda t: t if t is None or tf.is_tensor(t) else tf.convert_to_tensor(t), structure
    )


def zeros_like_spec(spec: Any) -> Any:
    def one(t):
        if t is None:
            return None
        shape = [1 if d is None else d for d in t.shape]
        return tf.zeros(shape, dtype=t.dtype)

    return tf.nest.map_structure(one, spec)


def batch_size(structure: Any) -> tf.Tensor:
    return tf.shape(next(t for t in tf.nest.flatten(structure) if t is not None))[0]


def spec_from(structure: Any) -> Any:
    def one(t):
        if t is None:
            return None
        dtype = getattr(t, "dtype", "float32")
        dtype = dtype.name if isinstance(dtype, tf.DType) else str(dtype)
        shape = tuple(t.shape)
        # The batch size of the data that built the model is not part of the model.
        return keras.KerasTensor((None,) + shape[1:] if shape else shape, dtype=dtype)

    return tf.nest.map_structure(one, structure)


def inputs_spec(data: Any) -> Any:
    """The inputs' spec (KerasTensors) of data a model is given: arrays, tensors or their
    specs (nested), or a ``tf.data.Dataset``'s element spec; None for data only running it
    would tell (a generator, a ``PyDataset``)."""
    if isinstance(data, tf.data.Dataset):
        data = keras.utils.unpack_x_y_sample_weight(data.element_spec)[0]
    leaves = tf.nest.flatten(data)
    if not leaves or not all(hasattr(t, "shape") and hasattr(t, "dtype") for t in leaves):
        return None
    return spec_from(data)


def separate_side_inputs(inputs: Any, side_inputs: tuple[str, ...]) -> tuple[Any, dict | None]:
    """A model's inputs as its main input and the dict of its ``side_inputs`` (None without)."""
    if not side_inputs:
        return inputs, None
    names = list(side_inputs)
    if not isinstance(inputs, dict) or any(n not in inputs for n in names):
        have = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        raise ValueError(
            f"tf_gpipe: this model takes side inputs {names}: call it with a dict holding "
            f"those keys and the main input (e.g. {{'inputs': x, '{names[0]}': ...}}); got {have}."
        )
    rest = {k: v for k, v in inputs.items() if k not in names}
    if not rest:
        raise ValueError(
            "tf_gpipe: the inputs dict holds only side inputs; add the main input, e.g. 'inputs'."
        )
    main = next(iter(rest.values())) if len(rest) == 1 else rest
    return main, {n: inputs[n] for n in names}
