"""Pipeline schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) as plain data, free of TensorFlow.

``tf_gpipe.schedules.schedule`` holds the data type, :class:`Schedule`, with its
checks and timing analysis (``tf_gpipe.schedules.timing``: the simulated
:class:`Timeline`, and devices sharing one host's processors);
``tf_gpipe.schedules.builders`` builds the named schedules' device orders (``get``).
Nothing here imports TensorFlow or Keras, so schedules can be built, simulated and
drawn without them (tests/test_schedules.py imports this package with TensorFlow made
unimportable).
"""

from tf_gpipe.schedules.builders import (
    SCHEDULES,
    bubble_fraction,
    clock_cycles,
    get,
    gpipe,
    interleaved,
    one_f_one_b,
    zb_h1,
)
from tf_gpipe.schedules.schedule import Action, Schedule
from tf_gpipe.schedules.timing import Slot, Timeline

__all__ = [
    "SCHEDULES",
    "Action",
    "Schedule",
    "Slot",
    "Timeline",
    "bubble_fraction",
    "clock_cycles",
    "get",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "zb_h1",
]
