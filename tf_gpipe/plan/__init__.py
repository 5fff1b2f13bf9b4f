"""Plan a pipeline: profile the layers once, predict every configuration, keep the fastest that fits.

``tf_gpipe.plan.profile`` measures each layer (forward and backward seconds, the
bytes its backward keeps, its weights), ``tf_gpipe.plan.predict`` prices a
configuration (simulated step time, peak memory per device),
``tf_gpipe.plan.search`` weighs stage cuts, K, M, re-materialization and schedule,
and ``tf_gpipe.plan.report`` holds the chosen :class:`Plan` and its report.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tf_gpipe import graph, tf_compat
from tf_gpipe.balance.profile import allocator_name
from tf_gpipe.plan import predict, profile, report, search  # noqa: F401  (predict: for readers)
from tf_gpipe.plan.predict import UpdateCost
from tf_gpipe.plan.profile import ModelProfile
from tf_gpipe.plan.report import Plan, PlanError
from tf_gpipe.plan.search import REMATS, Candidate

__all__ = [
    "REMATS",
    "Candidate",
    "ModelProfile",
    "Plan",
    "PlanError",
    "UpdateCost",
    "count_optimizer_slots",
    "measure_update",
    "plan",
    "plan_from_profile",
    "shares_host",
]


def count_optimizer_slots(optimizer: Any) -> int:
    """Slot variables a Keras optimizer keeps per trainable weight (Adam 2, SGD with momentum 1).

    Counted by building a fresh copy of ``optimizer`` (an instance or a name such as
    ``"adam"``) for one weight.
    """
    opt = keras.optimizers.get(optimizer)
    fresh = type(opt).from_config(opt.get_config())
    weight = keras.Variable(keras.ops.zeros((3, 7)), name="planner_probe")
    fresh.build([weight])
    return sum(1 for v in fresh.variables if tuple(v.shape) == (3, 7))


def measure_update(optimizer: Any, device: str = "/device:CPU:0", shape=(512, 512)) -> UpdateCost | None:
    """What ``optimizer``'s update allocates for a moment, per trainable byte, measured with
    the allocator on one weight of ``shape`` (a fresh copy of the optimizer); None where
    ``device``'s allocator keeps no statistics (CPU without ``TF_CPU_ALLOCATOR_USE_BFC=true``).
    """
    allocator = allocator_name(device)
    if allocator is None:
        return None
    # Earlier models' garbage, collected during the measurement, allocated into it (SGD measured
    # 1.8 weights' worth for 1.0 after a zb-h1 model in the same process): collected first.
    gc.collect()
    opt = keras.optimizers.get(optimizer)
    fresh = type(opt).from_config(opt.get_config())
    with tf.device(device):
        weight = keras.Variable(keras.ops.zeros(shape), name="planner_probe")
        total = tf.Variable(tf.ones(shape))  # stands in for a gradient-sum variable
        fresh.build([weight])

        def step(copy: bool) -> Any:
            @tf_compat.function(autograph=False)
            def update():
                # A copy is a gradient the update may overwrite, as the backward's own are.
                fresh.apply_gradients([(total * 1.0 if copy else total.read_value(), weight)])

            return update

        peaks = []
        for copy in (False, True):
            update = step(copy)
            update()  # traces
            tf.config.experimental.reset_memory_stats(allocator)
            base = tf.config.experimental.get_memory_info(allocator)["current"]
            update()
            peaks.append(tf.config.experimental.get_memory_info(allocator)["peak"] - base)
    size = float(tf.TensorShape(shape).num_elements() * 4)
    # The copied gradient is counted by static_bytes: not a temporary of the update.
    return UpdateCost(max(peaks[0] / size, 0.0), max(peaks[1] / size - 1.0, 0.0))


def plan(
    layers_or_model: Any,
    sample_input: Any,
    devices: int | Sequence[str],
    memory_budget_bytes: float,
    global_batch: int,
    *,
    optimizer: Any = None,
    optimizer_slots: int | None = None,
    schedules: Sequence[str] | None = None,
    remats: Sequence[str] = REMATS,
    max_micro_batches: int = 64,
    virtual_stages: int = 2,
    repeats: int = 5,
    profile_device: str | None = None,
    shared_host: bool | None = None,
) -> Plan:
    """Choose K, stage cuts, M, re-materialization and schedule for the fastest fitting step.

    Each layer is profiled once (forward and backward time, the activation bytes
    its backward keeps, its weights) at the smallest and the largest micro-batch
    considered; then every configuration is priced by simulation: K from 1 to the
    number of devices, M among the divisors of ``global_batch`` and the powers of
    two up to ``max_micro_batches``, each remat mode and schedule, and two cuts
    (even time, even memory). The fastest whose predicted peak memory fits
    ``memory_budget_bytes`` on every device wins.

    Args:
        layers_or_model: Keras layers (a list, or a ``keras.Sequential``), as for
            ``PipelineModel``; or a functional model (skip connections, several inputs),
            planned node by node as ``PipelineModel.from_model`` cuts it: its plan's
            ``balance`` counts nodes, and it is used as ``from_model(model, plan=p)``.
        sample_input: a batch, a shape such as ``(32, 784)``, or ``keras.Input``;
            its batch dimension is replaced by the micro-batch sizes profiled. None for a
            functional model: its inputs.
        devices: device strings (the plan uses the first K), or a device count.
        memory_budget_bytes: the most bytes any device may hold.
        global_batch: examples per training step.
        optimizer: the optimizer (instance or name), to count its slots; or give
            ``optimizer_slots`` (default 2, Adam's).
        schedules: schedule names to weigh; default ``"gpipe"``, ``"1f1b"``,
            ``"interleaved"`` and ``"zb-h1"``.
            ``"1f1b"`` and later compute the loss per micro-batch (see ``PipelineModel``).
        remats: remat modes to weigh.
        max_micro_batches: the largest M tried.
        virtual_stages: v for ``"interleaved"``.
        repeats: timed calls per layer and batch size.
        profile_device: where layers are timed; default the first device given, else CPU.
        shared_host: whether the devices share one host's processors, so that stages running
            at once slow each other (logical CPUs of one machine); default: True when every
            device is a CPU of this process (``/device:CPU:i``, or a count with no
            accelerator present), False otherwise.

    Returns:
        A :class:`Plan`: ``PipelineModel(layers, plan=p)``; ``p.report()`` explains it.

    Raises:
        PlanError: nothing fits; the message says what would (more devices, more
            micro-batches, re-materialization, a smaller batch).

    Example:
        >>> p = tf_gpipe.plan(layers, (None, 784), ["/CPU:0", "/CPU:1"], 2**30, global_batch=256)
        >>> model = tf_gpipe.PipelineModel(layers, plan=p); print(p.report())  # doctest: +SKIP
    """
    items, of_graph = layers_or_model, False
    if isinstance(layers_or_model, keras.Model) and not isinstance(layers_or_model, keras.Sequential):
        # A functional model is planned node by node, as from_model cuts it: each node a
        # stage of its own, taking and returning what crosses the cut after it (skips too).
        items, of_graph = graph.node_stages(layers_or_model), True
        if sample_input is None:
            sample_input = graph.input_spec(layers_or_model)
    _check(devices, global_batch, memory_budget_bytes, remats)
    if optimizer is not None and optimizer_slots is not None:
        raise ValueError("tf_gpipe: give optimizer or optimizer_slots, not both.")
    slots = count_optimizer_slots(optimizer) if optimizer is not None else optimizer_slots
    sizes = [-(-global_batch // m) for m in search.micro_batch_counts(global_batch, max_micro_batches)]
    if profile_device is None:
        profile_device = devices[0] if not isinstance(devices, int) and not isinstance(devices, str) else None
    profiled = profile.profile_layers(
        items,
        sample_input,
        [min(sizes), max(sizes)],
        repeats=repeats,
        device=profile_device or "/device:CPU:0",
    )
    profiled = dataclasses.replace(profiled, of_graph=of_graph)
    device = profile_device or "/device:CPU:0"
    return plan_from_profile(
        profiled,
        devices,
        memory_budget_bytes,
        global_batch,
        optimizer_slots=2 if slots is None else slots,
        update=measure_update(optimizer, device) if optimizer is not None else None,
        schedules=schedules,
        remats=remats,
        max_micro_batches=max_micro_batches,
        virtual_stages=virtual_stages,
        shared_host=shared_host,
    )


def shares_host(devices: int | str | Sequence[str]) -> bool:
    """Whether ``devices`` share one host's processors: every one a CPU of this process
    (no job, or one job and task for all), or, for a count, no accelerator present."""
    if isinstance(devices, int):
        return all(d.device_type == "CPU" for d in tf.config.list_logical_devices())
    specs = [tf.DeviceSpec.from_string(d) for d in ([devices] if isinstance(devices, str) else devices)]
    places = {(s.job, s.replica, s.task) for s in specs}
    return all((s.device_type or "CPU").upper() == "CPU" for s in specs) and len(places) == 1


def _check(devices: Any, global_batch: Any, memory_budget_bytes: Any, remats: Sequence[str]) -> int:
    """The device count, after checking the arguments ``plan`` and ``plan_from_profile`` share."""
    count = devices if isinstance(devices, int) and not isinstance(devices, bool) else None
    if count is None:
        count = 1 if isinstance(devices, str) else len(list(devices))
    if count < 1:
        raise ValueError(f"tf_gpipe: plan needs at least one device, got {devices!r}.")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"tf_gpipe: global_batch must be an integer >= 1, got {global_batch!r}.")
    if not memory_budget_bytes > 0:
        raise ValueError(f"tf_gpipe: memory_budget_bytes must be > 0, got {memory_budget_bytes!r}.")
    bad = [r for r in remats if r not in REMATS]
    if bad or not remats:
        raise ValueError(f"tf_gpipe: remats must be some of {list(REMATS)}, got {list(remats)!r}.")
    return count


def plan_from_profile(
    profiled: ModelProfile,
    devices: int | Sequence[str],
    memory_budget_bytes: float,
    global_batch: int,
    *,
    optimizer_slots: int = 2,
    schedules: Sequence[str] | None = None,
    remats: Sequence[str] = REMATS,
    max_micro_batches: int = 64,
    virtual_stages: int = 2,
    update: UpdateCost | None = None,
    shared_host: bool | None = None,
) -> Plan:
    """:func:`plan` from a profile already taken: re-plan for another budget, batch or
    device count without measuring again (``p.profile`` is the profile a plan used).

    Args:
        profiled: a ``ModelProfile`` (``p.profile``, or ``profile.profile_layers(...)``).
        update: the optimizer update's temporaries (:func:`measure_update`; ``plan``
            measures them when given ``optimizer``); default estimated from ``optimizer_slots``.
        Others: as for :func:`plan`.
    """
    update = UpdateCost.estimate(optimizer_slots) if update is None else update
    count = _check(devices, global_batch, memory_budget_bytes, remats)
    shared_host = shares_host(devices) if shared_host is None else bool(shared_host)
    device_list = (
        None if isinstance(devices, int) else [devices] if isinstance(devices, str) else list(devices)
    )
    if schedules is None:
        schedules = ["gpipe", "1f1b", "interleaved", "zb-h1"]
    options = dict(
        num_devices=list(range(1, min(count, len(profiled.layers)) + 1)),
        global_batch=global_batch,
        memory_budget_bytes=memory_budget_bytes,
        optimizer_slots=optimizer_slots,
        schedule_names=list(schedules),
        remats=list(remats),
        max_micro_batches=max_micro_batches,
        virtual_stages=virtual_stages,
        update=update,
        shared_host=shared_host,
    )
    candidates = search.search(profiled, **options)  # type: ignore[arg-type]
    fitting = [c for c in candidates if c.fits]
    if not fitting:

        def alternatives(**changes: Any) -> list:
            return search.search(profiled, **{**options, **changes})

        raise report.nothing_fits(
            candidates,
            memory_budget_bytes,
            count,
            optimizer_slots,
            alternatives,
            global_batch,
            len(profiled.layers),
        )
    return Plan(
        chosen=fitting[0],
        candidates=candidates,
        device_list=device_list,
        memory_budget_bytes=float(memory_budget_bytes),
        global_batch=global_batch,
        optimizer_slots=optimizer_slots,
        profile=profiled,
        update=update,
        shared_host=shared_host,
    )
