"""tf_gpipe needs Keras on its TensorFlow backend: say so plainly where it is not."""

from __future__ import annotations

import importlib

__all__: list[str] = []


def check_backend() -> None:
    """Raise ``RuntimeError`` unless Keras runs on TensorFlow.

    The stages are TensorFlow functions placed on TensorFlow devices, and the layers'
    variables must be TensorFlow variables: on another backend nothing would work, and
    the first failure would be far from its cause.
    """
    # The Keras loaded now: keras.config.set_backend re-imports Keras under a new backend,
    # so a reference taken at import time would still report the old one.
    name = importlib.import_module("keras").backend.backend()
    if name != "tensorflow":
        raise RuntimeError(
            f"tf_gpipe: Keras is running on the {name!r} backend, but tf_gpipe needs the "
            "TensorFlow backend. Set the environment variable KERAS_BACKEND=tensorflow before "
            'Keras is imported (or "backend": "tensorflow" in ~/.keras/keras.json).'
        )
