"""Predict a configuration's step time and peak memory per device from the layer profiles.

Time: each stage's forward and backward are the sums of its layers' (a re-materialized
stage's backward adds its forward again), and the schedule's simulation
(``Schedule.simulate``) gives the step time and bubble. Memory per device: weights,
optimizer slots and gradient sums, plus activations walked through the device's own
order of actions: a forward leaves its stash (the stage input with re-materialization,
every tensor the backward keeps without), a backward frees it, and while a backward
runs the micro-batch's full activations (re-computed, with remat) and its gradients
are live beside every stash still held. Ignored: the loss, the traced graph, allocator
fragmentation, the copies between devices, and each action's fixed call overhead
beyond what the profile measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from tf_gpipe.partition import split_by_balance
from tf_gpipe.plan.profile import LayerProfile, ModelProfile
from tf_gpipe.schedules import Action, Schedule, Timeline

__all__ = ["StageCost", "device_memory", "process_peak", "stage_costs", "step_time"]


@dataclass(frozen=True)
class StageCost:
    """One (virtual) stage at one micro-batch size: seconds and bytes."""

    forward_s: float
    backward_s: float  # the full backward, without re-computation
    input_bytes: float  # the stage input of one micro-batch: its stash with remat
    activation_bytes: float  # everything the backward keeps, the input included
    work_bytes: float  # the largest layer's input plus output: gradients in flight
    weight_grad_bytes: int  # the largest layer's weight gradients, made before being summed
    trainable_bytes: int
    non_trainable_bytes: int


def _stage(profiles: Sequence[LayerProfile], n: int, call: ModelProfile) -> StageCost:
    at = {id(p): (p.input_bytes.at(n), p.output_bytes.at(n)) for p in profiles}
    activations = profiles[0].input_bytes.at(n) + sum(p.saved_bytes.at(n) for p in profiles)
    for i, p in enumerate(profiles):
        used_by_next = i + 1 < len(profiles) and profiles[i + 1].uses_input
        if p.saves_output or used_by_next:
            activations += at[id(p)][1]
    return StageCost(
        forward_s=sum((p.forward_s for p in profiles), call.forward_call_s).at(n),
        backward_s=sum((p.backward_s for p in profiles), call.backward_call_s).at(n),
        input_bytes=profiles[0].input_bytes.at(n),
        activation_bytes=activations,
        work_bytes=max(i + o for i, o in at.values()),
        weight_grad_bytes=max(p.trainable_bytes for p in profiles),
        trainable_bytes=sum(p.trainable_bytes for p in profiles),
        non_trainable_bytes=sum(p.non_trainable_bytes for p in profiles),
    )


def stage_costs(profile: ModelProfile, balance: Sequence[int], n: int) -> List[StageCost]:
    """Each stage's costs for micro-batches of ``n`` examples; ``balance``: layers per stage.

    A stage's time is its layers' plus one function call's overhead per action."""
    return [_stage(group, n, profile) for group in split_by_balance(list(profile.layers), None, balance)]


def step_time(
    schedule: Schedule, stages: Sequence[StageCost], remat: Sequence[bool]
) -> Tuple[float, float, Timeline]:
    """``(seconds, bubble, timeline)`` of one step: a re-materialized backward replays the forward."""
    fwd = [s.forward_s for s in stages]
    bwd = [s.backward_s + (s.forward_s if r else 0.0) for s, r in zip(stages, remat)]
    timeline = schedule.simulate(fwd, bwd)
    busy = sum(timeline.busy(d) for d in range(schedule.num_devices))
    total = schedule.num_devices * timeline.makespan
    return timeline.makespan, (total - busy) / total if total > 0 else 0.0, timeline


def static_bytes(stage: StageCost, optimizer_slots: int) -> float:
    """Weights, their optimizer slots and their gradient sums (fit keeps a sum per trainable
    weight when M > 1; with M = 1 the gradients, as many bytes, live until the update)."""
    return stage.trainable_bytes * (2 + optimizer_slots) + stage.non_trainable_bytes


def _events(
    schedule: Schedule, stages: Sequence[StageCost], remat: Sequence[bool]
) -> Dict[int, List[Tuple[Action, float, float]]]:
    """Per device, for each action in its order: (action, bytes live while it runs, after it)."""
    release = "W" if schedule.split_backward else "B"
    out: Dict[int, List[Tuple[Action, float, float]]] = {}
    for d, actions in enumerate(schedule.orders):
        live = _initial(schedule, stages, d)
        rows = []
        for a in actions:
            s = stages[a.stage]
            stash = s.input_bytes if remat[a.stage] else s.activation_bytes
            if a.stage == 0:
                stash -= s.input_bytes  # counted up front
            if a.kind == "F":
                kept = 0.0 if remat[a.stage] else s.activation_bytes - s.input_bytes
                during = live + kept + s.work_bytes
                live += stash
            else:
                # A replay rebuilds what the stash lacks; gradients of one layer are in flight.
                rebuilt = s.activation_bytes - s.input_bytes if remat[a.stage] else 0.0
                during = live + rebuilt + s.work_bytes + s.weight_grad_bytes
                if a.kind == release:
                    live -= stash + (s.input_bytes if a.stage == 0 else 0.0)
            rows.append((a, during, live))
        out[d] = rows
    return out


def device_memory(
    schedule: Schedule, stages: Sequence[StageCost], remat: Sequence[bool], optimizer_slots: int
) -> List[float]:
    """Predicted peak bytes per device: static bytes of its stages plus its activation peak."""
    static = [0.0] * schedule.num_devices
    for i, s in enumerate(stages):
        static[schedule.device_of(i)] += static_bytes(s, optimizer_slots)
    events = _events(schedule, stages, remat)
    return [static[d] + max((during for _, during, _ in events[d]), default=0.0) for d in events]


def process_peak(
    schedule: Schedule,
    stages: Sequence[StageCost],
    remat: Sequence[bool],
    optimizer_slots: int,
    timeline: Optional[Timeline] = None,
) -> float:
    """Predicted peak bytes of all devices together, on the simulated timeline.

    For one allocator shared by every device (logical CPUs): the devices' peaks
    need not coincide, so this is at most the sum of :func:`device_memory`.
    """
    if timeline is None:
        timeline = step_time(schedule, stages, remat)[2]
    static = sum(static_bytes(s, optimizer_slots) for s in stages)
    changes: List[Tuple[float, int, int, float]] = []  # (time, ends first, device, bytes from then on)
    for d, rows in _events(schedule, stages, remat).items():
        changes.append((0.0, 0, d, _initial(schedule, stages, d)))
        for a, during, after in rows:
            slot = timeline.slots[a]
            changes.append((slot.start, 1, d, during))
            changes.append((slot.end, 0, d, after))
    current: Dict[int, float] = {}
    peak = 0.0
    for _, _, d, value in sorted(changes, key=lambda c: (c[0], c[1])):
        current[d] = value
        peak = max(peak, sum(current.values()))
    return static + peak


def _initial(schedule: Schedule, stages: Sequence[StageCost], d: int) -> float:
    """Stage 0's inputs are the split mini-batch: every micro-batch is there from the start."""
    return schedule.num_micro_batches * stages[0].input_bytes if d == schedule.device_of(0) else 0.0
