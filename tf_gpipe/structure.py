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
