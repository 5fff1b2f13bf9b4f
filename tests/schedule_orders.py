"""Schedule orders for tests, written as text and copied with new orders (no TensorFlow)."""

from tf_gpipe.schedules import Action, Schedule


def parse(text):
    """``"F0@s1 B0@s1 W0@s1"`` -> the actions, written as :func:`repr` shows them."""
    actions = []
    for word in text.split():
        kind_mb, stage = word.split("@s")
        actions.append(Action(kind_mb[0], int(stage), int(kind_mb[1:])))
    return actions


def copy(schedule, orders):
    """``schedule`` with other per-device ``orders`` (same name, sizes and backward split)."""
    return Schedule(
        schedule.name,
        schedule.num_devices,
        schedule.num_micro_batches,
        schedule.virtual_stages,
        orders,
        schedule.split_backward,
    )
