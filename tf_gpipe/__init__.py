"""tf_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

import keras as _keras

from tf_gpipe.backend import check_backend as _check_backend

_check_backend()  # before any module that reaches into Keras' TensorFlow backend

from tf_gpipe import schedules, timeline  # noqa: E402
from tf_gpipe.devices import configure_virtual_cpus, exact_float32  # noqa: E402
from tf_gpipe.model import PipelineModel  # noqa: E402
from tf_gpipe.plan import Plan, plan  # noqa: E402  (the function shadows the package name)
from tf_gpipe.replay import is_recomputing  # noqa: E402
from tf_gpipe.schedules import bubble_fraction  # noqa: E402

# Keras' legacy .h5 format (ModelCheckpoint("best.h5"), model.save("m.h5")) records the bare
# class name and looks it up among the custom objects by that name, while the .keras format
# uses the registered "tf_gpipe>PipelineModel": answer to both, so either file loads.
_keras.saving.get_custom_objects().setdefault("PipelineModel", PipelineModel)

__version__ = "0.1.0"

__all__ = [
    "PipelineModel",
    "Plan",
    "bubble_fraction",
    "configure_virtual_cpus",
    "exact_float32",
    "is_recomputing",
    "plan",
    "schedules",
    "timeline",
]
