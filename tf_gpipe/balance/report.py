"""The partition report: a ``model.summary()``-like table with the predicted bubble."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tf_gpipe import schedules
from tf_gpipe.balance.profile import Layers, listed_layers, nbytes, run_unsplit
from tf_gpipe.devices import default_devices
from tf_gpipe.partition import split_by_balance

__all__ = ["report"]


def report(
    layers: Layers,
    balance: Sequence[int],
    sample: Any = None,
    *,
    time_costs: Sequence[float] | None = None,
    devices: Sequence[str] | None = None,
    num_micro_batches: int = 1,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
    batch_size: int = 32,
) -> str:
    """A ``model.summary()``-like table of a partition, with its predicted bubble and imbalance.

    Per stage: device, parameters, time (sum of ``time_costs``), activations
    (outputs for ``sample``) and layer names. Then max/mean of the stage times
    (parameters without ``time_costs``) and, with them, the step time and bubble
    :meth:`~tf_gpipe.schedules.Schedule.simulate` predicts (each layer's time split
    1:2 into forward and backward) beside those of perfectly even stages.

    Args:
        layers, sample, batch_size: as for :func:`by_params`; unbuilt layers need ``sample``.
        balance: layers per stage (``num_stages * virtual_stages`` entries).
        time_costs: seconds per layer, e.g. from :func:`by_time`.
        devices: one per pipeline position; default: those PipelineModel would pick.
        num_micro_batches: M, for the predicted bubble.
        schedule, virtual_stages: as for PipelineModel; stage ``s`` runs on device ``s % K``.

    Returns:
        The report as one string.

    Example:
        >>> layers = [keras.layers.Dense(64) for _ in range(4)]
        >>> print(report(layers, [2, 2], (32, 64), time_costs=by_time(layers, (32, 64))))  # doctest: +SKIP
    """
    layer_list, spec = listed_layers(layers)
    groups = split_by_balance(list(range(len(layer_list))), None, balance)
    if len(groups) % virtual_stages:
        raise ValueError(f"tf_gpipe: balance has {len(groups)} stages, not a multiple of virtual_stages.")
    if time_costs is not None and len(time_costs) != len(layer_list):
        raise ValueError(f"tf_gpipe: time_costs has {len(time_costs)} entries for {len(layer_list)} layers.")
    known: dict[str, Sequence[float] | None] = {"time": time_costs, "activations": None}
    if sample is not None or spec is not None or not all(layer.built for layer in layer_list):
        records = run_unsplit(layer_list, spec if sample is None else sample, batch_size)[1]
        known["activations"] = [nbytes(y) for _, _, y in records]
    params = [layer.count_params() for layer in layer_list]
    known["params"] = params
    per = {k: None if v is None else [float(sum(v[i] for i in g)) for g in groups] for k, v in known.items()}
    num_devices = len(groups) // virtual_stages
    devices = list(devices) if devices is not None else default_devices(num_devices)
    if len(devices) != num_devices:
        raise ValueError(f"tf_gpipe: got {len(devices)} devices for {num_devices}; give one per device.")
    headers = ["stage", "device", "params", "time (ms)", "activations (MiB)", "layers"]

    def cell(key: str, s: int, scale: float, pattern: str) -> str:
        values = per[key]
        return "-" if values is None else format(values[s] * scale, pattern)

    rows = [headers] + [
        [
            str(s),
            devices[s % num_devices],
            cell("params", s, 1, ",.0f"),
            cell("time", s, 1e3, ".3f"),
            cell("activations", s, 2**-20, ".2f"),
            ", ".join(layer_list[i].name for i in g),
        ]
        for s, g in enumerate(groups)
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]  # the names, last, are not padded
    table = [
        "  ".join([r[c].ljust(w) if c < 2 else r[c].rjust(w) for c, w in enumerate(widths)] + [r[5]])
        for r in rows
    ]
    lines = [
        f"Pipeline partition: {len(layer_list)} layers, balance={list(balance)}, {num_devices} devices, "
        f"M={num_micro_batches}, schedule={schedule!r}",
        table[0],
        "-" * len(table[0]),
        *table[1:],
        f"Total params: {sum(params):,}",
    ]
    basis = "time" if time_costs is not None else "params"
    stage = per[basis]
    assert stage is not None  # params are always known, time is the basis only when given
    mean = sum(stage) / len(stage)
    lines.append(f"Stage imbalance (max/mean {basis}): " + (f"{max(stage) / mean:.2f}" if mean else "n/a"))
    plan = schedules.get(schedule, num_devices, num_micro_batches, virtual_stages)
    even = plan.bubble_fraction(1.0, 2.0)
    if time_costs is None or not mean:
        lines.append(f"Bubble with even stages: {even:.1%} (pass time_costs=by_time(...) to predict)")
    else:
        fwd, bwd = [t / 3 for t in stage], [2 * t / 3 for t in stage]
        step, ideal = plan.simulate(fwd, bwd).makespan, plan.simulate(mean / 3, 2 * mean / 3).makespan
        lines.append(
            f"Predicted step: {step * 1e3:.3f} ms, bubble {plan.bubble_fraction(fwd, bwd):.1%}; "
            f"perfectly even stages: {ideal * 1e3:.3f} ms, bubble {even:.1%}"
        )
    return "\n".join(lines)
