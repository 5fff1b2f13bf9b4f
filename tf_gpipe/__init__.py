"""tf_gpipe: GPipe pipeline parallelism for TensorFlow 2 and Keras 3."""

from tf_gpipe import schedules, timeline
from tf_gpipe.devices import configure_virtual_cpus, exact_float32
from tf_gpipe.model import PipelineModel
from tf_gpipe.plan import Plan, plan  # the function shadows the package name: tf_gpipe.plan(...)
from tf_gpipe.remat import is_recomputing
from tf_gpipe.schedules import bubble_fraction

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
