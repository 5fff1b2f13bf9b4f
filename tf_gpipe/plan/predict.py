"""Predict a configuration's step time and peak memory per device from the layer profiles.

Time: each stage's forward and backward are the sums of its layers' (a re-materialized
stage's backward adds its forward again), and the schedule's simulation
(``Schedule.simulate``) gives the step time and bubble. A split schedule's (zb-h1) B and W
are priced as the engine runs them: B differentiates w.r.t. the stage input only (after
replaying the forward, re-materialized) and hands W the gradients at each op that reads a
weight, and W runs each layer's weight half alone (:func:`_backward_halves`). Stage 0 has
no B: its W is its whole backward (after a replay, re-materialized).

Memory per device: weights, optimizer slots and gradient sums, plus activations walked
through the device's own order of actions: a forward leaves its stash (the stage input
with re-materialization, every tensor the backward keeps without), a backward frees it.
While a backward runs, the micro-batch's own activations (re-computed, with remat) are
live up to the layer whose backward runs, beside that layer's measured peak (its
gradients and buffers: ``LayerProfile.backward_peak``) and every other stash still held.
Split: a B frees nothing as it goes, and leaves its W what the W reads (the inputs of the
ops that read a weight and their gradients: ``LayerProfile.weight_half_bytes``; a
re-materialized stage's, of its replay), and the output gradient it received; W frees them.
After the last backward the optimizer update runs: its temporaries (:class:`UpdateCost`,
measured per optimizer) beside the weights, slots and gradients, when the activations are
gone; a device's peak is the larger of the two phases. Static bytes include, with gradient
sums, the constants the step function holds to zero them (one per distinct weight shape
and stage). Ignored: the loss, the traced graph, allocator fragmentation and the copies
between devices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tf_gpipe.partition import split_by_balance
from tf_gpipe.plan.profile import LayerProfile, ModelProfile
from tf_gpipe.schedules import Action, Schedule, Timeline

__all__ = ["StageCost", "UpdateCost", "device_memory", "process_peak", "stage_costs", "step_time"]


@dataclass(frozen=True)
class StageCost:
    """One (virtual) stage at one micro-batch size: seconds and bytes."""

    forward_s: float
    backward_s: float  # the full backward, without re-computation
    input_grad_s: float  # a split schedule's B (the input gradient), without re-computation
    weight_grad_s: float  # its W (the weight gradient) when re-materialized, the replay aside
    kept_weight_grad_s: float  # its W when the stage keeps its activations
    input_bytes: float  # the stage input of one micro-batch: its stash with remat
    activation_bytes: float  # everything the backward keeps, the input included
    forward_bytes: float  # the most a forward without a tape adds beside its input
    taped_forward_bytes: float  # the most a taped forward adds beside its input (its stash included)
    backward_bytes: float  # the most a backward holds: its input, activations, gradients, buffers
    taped_input_grad_bytes: float  # the most a split B on a tape holds: it frees nothing (W reads it all)
    output_bytes: float  # the stage output of one micro-batch: its gradient, kept from B until W
    weight_half_bytes: float  # what a split B leaves its W (``LayerProfile.weight_half_bytes``)
    trainable_bytes: int
    non_trainable_bytes: int
    # One buffer per distinct weight shape: the zeros that reset the gradient sums each step
    # (M > 1), which Grappler folds into constants the step function holds as long as it lives.
    sum_zeros_bytes: float = 0.0
    # Per action kind ("F", full backward "B", split input half "I", split weight half "W"),
    # its layers in the order they run: (seconds alone, share of the host's processors);
    # None where the profile measured no shares.
    host_segments: dict[str, tuple[tuple[float, float], ...]] | None = None
    # The weights this stage uses that a later stage holds (``ModelProfile.shared``): (the
    # weight's index there, its bytes, the stage holding it). The stage keeps its part of
    # their gradient and, on another device than the holder's, a copy (``Cell.copied``).
    borrowed: tuple[tuple[int, float, int], ...] = ()


@dataclass(frozen=True)
class UpdateCost:
    """Bytes the optimizer update allocates for a moment, per trainable byte.

    Keras' optimizers build each new slot and weight value from temporaries (Adam:
    ``(g - m) * (1 - beta_1)`` and the step ``m * alpha / (sqrt(v) + eps)``, two weights'
    worth), and the updates of different weights run at once. ``from_sums``: the
    gradients are reads of fit's gradient-sum variables (M > 1), whose buffers no
    update may overwrite; ``from_fresh``: the backward's own gradients (M = 1), which
    an update may reuse (the gradients themselves are counted by :func:`static_bytes`).
    """

    from_sums: float
    from_fresh: float

    @classmethod
    def estimate(cls, optimizer_slots: int) -> UpdateCost:
        """Without allocator statistics: Adam's and SGD's measured values (two, one temporary
        weight per weight with sums; one fewer when the gradients may be overwritten)."""
        temporaries = float(max(optimizer_slots, 1))
        return cls(temporaries, temporaries - 1.0)

    def bytes(self, trainable_bytes: float, num_micro_batches: int) -> float:
        return trainable_bytes * (self.from_sums if num_micro_batches > 1 else self.from_fresh)


def _halves(p: LayerProfile, n: int) -> tuple[float, float]:
    """A layer's backward w.r.t. its input only and w.r.t. its weights only (half each if unknown)."""
    if p.input_grad_s is None or p.weight_grad_s is None:
        return p.backward_s.at(n) / 2, p.backward_s.at(n) / 2
    return p.input_grad_s.at(n), p.weight_grad_s.at(n)


def _weight_layers(
    profiles: Sequence[LayerProfile], n: int, first: bool
) -> tuple[list[tuple[int, float]], bool]:
    """What a split W runs, bottom up, as ``(layer index, seconds)``: the lowest layer with
    weights (its weight half; its whole backward when it is the model's first layer, which
    makes no input gradient) and the whole backward of every layer above it. Also whether
    that lowest layer runs whole."""
    lowest = next((i for i, p in enumerate(profiles) if p.trainable_bytes > 0), None)
    if lowest is None:
        return [], False
    whole = first and lowest == 0
    bottom = profiles[lowest].backward_s.at(n) if whole else _halves(profiles[lowest], n)[1]
    return [(lowest, bottom)] + [
        (i, profiles[i].backward_s.at(n)) for i in range(lowest + 1, len(profiles))
    ], whole


def _backward_halves(
    profiles: Sequence[LayerProfile], n: int, first: bool
) -> tuple[float, float, float, float]:
    """``(full, input, weight, kept weight)`` backward seconds of a stage's layers (no call
    overhead).

    ``input`` (B) is every layer's input half: the chain down to the stage input.
    ``weight`` (W of a re-materialized stage): the weight gradient of a layer needs the
    gradient of its output, which its replay must make again, so from the top down to the
    lowest layer with weights W runs each layer's whole backward and that layer's weight
    half; below it, nothing (what a W that replayed its stage would run). ``kept weight``
    (the W the engine runs after a split B, ``tf_gpipe.stash``): every layer's weight half,
    from the gradients its B handed on.
    The first stage computes no input gradient: its full backward is its W (and its split
    B does nothing)."""
    full = [p.backward_s.at(n) for p in profiles]
    halves = [_halves(p, n) for p in profiles]
    layers, whole = _weight_layers(profiles, n, first)
    weight = 0.0 if not layers else layers[0][1] + sum(s for _, s in layers[1:])
    if whole:  # the model's first layer: its backward has no input gradient
        weight = sum(full)
    if first:
        return weight, 0.0, weight, weight
    return sum(full), sum(h[0] for h in halves), weight, sum(h[1] for h in halves)


def _stage(profiles: Sequence[LayerProfile], n: int, call: ModelProfile, first: bool = False) -> StageCost:
    """Walk the stage's layers in order. While layer ``i`` runs, the layers before it hold what
    their backward keeps (with a tape, or during a replay) and layer ``i`` its measured peak.
    ``first``: the model's first stage (no input gradient)."""
    kept_before, forward, taped, backward = 0.0, 0.0, 0.0, 0.0
    own = []  # (what each layer keeps for the backward, its backward's peak)
    for i, p in enumerate(profiles):
        peak_f, peak_b = p.forward_peak.at(n), p.backward_peak.at(n)
        forward = max(forward, peak_f + (p.input_bytes.at(n) if i > 0 else 0.0))
        taped = max(taped, kept_before + peak_f)
        backward = max(backward, kept_before + peak_b)
        keeps = p.saved_bytes.at(n)
        if p.saves_output or (i + 1 < len(profiles) and profiles[i + 1].uses_input):
            keeps += p.output_bytes.at(n)
        kept_before += keeps
        own.append((keeps, peak_b))
    # A split B on a tape leaves every kept tensor to its W: while layer i's input gradient
    # runs, the layers above it still hold theirs (a full backward has freed them by then).
    taped_input_grad = max(kept_before - keeps + peak_b for keeps, peak_b in own)
    full, input_grad, weight_grad, kept_weight_grad = _backward_halves(profiles, n, first)
    call_b = call.backward_call_s.at(n)
    first_bytes = profiles[0].input_bytes.at(n)
    host_segments = _host_segments(profiles, n, first)
    return StageCost(
        forward_s=sum((p.forward_s for p in profiles), call.forward_call_s).at(n),
        backward_s=full + call_b,
        input_grad_s=0.0 if first else input_grad + call_b,  # the first stage's B is no call
        weight_grad_s=weight_grad + call_b,
        kept_weight_grad_s=kept_weight_grad + call_b,
        input_bytes=first_bytes,
        activation_bytes=first_bytes + kept_before,
        forward_bytes=forward,
        taped_forward_bytes=taped,
        backward_bytes=first_bytes + backward,
        taped_input_grad_bytes=first_bytes + taped_input_grad,
        output_bytes=profiles[-1].output_bytes.at(n),
        weight_half_bytes=(
            sum(p.weight_half_bytes.at(n) for p in profiles if p.weight_half_bytes is not None)
            if all(p.weight_half_bytes is not None for p in profiles)
            else first_bytes + kept_before  # not measured: all it keeps
        ),
        trainable_bytes=sum(p.trainable_bytes for p in profiles),
        non_trainable_bytes=sum(p.non_trainable_bytes for p in profiles),
        sum_zeros_bytes=float(
            sum(math.prod(shape) * size for shape, size in {w for p in profiles for w in p.weight_shapes})
        ),
        host_segments=host_segments,
    )


def _host_segments(
    profiles: Sequence[LayerProfile], n: int, first: bool
) -> dict[str, tuple[tuple[float, float], ...]] | None:
    """Each action kind's layers in the order they run, as (seconds, host share): the forward
    bottom up, the backward top down; a split W from the top down to the lowest layer with
    weights (its weight half), as :func:`_backward_halves` prices it."""
    if any(p.host_share is None for p in profiles):
        return None
    share = [float(p.host_share) for p in profiles]  # type: ignore[arg-type]
    halves = [_halves(p, n) for p in profiles]
    full = [p.backward_s.at(n) for p in profiles]
    down = range(len(profiles) - 1, -1, -1)
    weight = [(seconds, share[i]) for i, seconds in reversed(_weight_layers(profiles, n, first)[0])]
    # The model's first stage makes no input gradient: its backward is its W.
    backward = tuple(weight) if first else tuple((full[i], share[i]) for i in down)
    return {
        "F": tuple((p.forward_s.at(n), f) for p, f in zip(profiles, share)),
        "B": backward,
        "I": () if first else tuple((halves[i][0], share[i]) for i in down),
        "W": tuple(weight),
        "K": tuple(weight) if first else tuple((halves[i][1], share[i]) for i in down),  # kept W
    }


def stage_costs(profile: ModelProfile, balance: Sequence[int], n: int) -> list[StageCost]:
    """Each stage's costs for micro-batches of ``n`` examples; ``balance``: layers per stage.

    A stage's time is its layers' plus one function call's overhead per action."""
    groups = split_by_balance(list(profile.layers), None, balance)
    stages = [_stage(group, n, profile, first=s == 0) for s, group in enumerate(groups)]
    return _shared(stages, profile, balance) if profile.shared else stages


def _shared(stages: list[StageCost], profile: ModelProfile, balance: Sequence[int]) -> list[StageCost]:
    """Each shared weight counted once, as a weight (slots, update), by the last stage using
    it, where the step keeps it; every other stage using it borrows it (``borrowed``). Each
    layer's profile counts it, so a stage using it twice held it twice."""
    stage_of = [s for s, size in enumerate(balance) for _ in range(size)]
    trainable = [float(s.trainable_bytes) for s in stages]
    borrowed: list[list[tuple[int, float, int]]] = [[] for _ in stages]
    for w, (at, size) in enumerate(profile.shared):
        users = [stage_of[i] for i in at]
        owner = max(users)
        for s in sorted(set(users)):
            trainable[s] -= size * (users.count(s) - (s == owner))
            if s != owner:
                borrowed[s].append((w, float(size), owner))
    return [
        dataclasses.replace(st, trainable_bytes=int(t), borrowed=tuple(b))
        for st, t, b in zip(stages, trainable, borrowed)
    ]


def step_time(
    schedule: Schedule, stages: Sequence[StageCost], remat: Sequence[bool], shared_host: bool = False
) -> tuple[float, float, Timeline]:
    """``(seconds, bubble, timeline)`` of one step: a re-materialized backward replays the forward,
    a split one in B (in W on the first stage, whose B does nothing).
    ``shared_host``: the devices share one host's processors (logical CPUs of one machine):
    the simulation shares them among the running actions' layers (``Schedule.simulate``'s
    ``host_share``), from each layer's measured share."""
    host = None
    if shared_host and all(s.host_segments is not None for s in stages):
        seg = [s.host_segments for s in stages]

        def replayed(kind: str, again: Sequence[bool]) -> list[list[tuple[float, float]]]:
            return [list(g["F"] if r else ()) + list(g[kind]) for g, r in zip(seg, again)]  # type: ignore[index]

        host = {"F": [list(g["F"]) for g in seg]}  # type: ignore[index]
        if schedule.split_backward:
            host["B"] = replayed("I", [r and i > 0 for i, r in enumerate(remat)])
            host["W"] = [
                list(g["F"]) + list(g["W"]) if r and i == 0 else list(g["K"])  # type: ignore[index]
                for i, (g, r) in enumerate(zip(seg, remat))
            ]
        else:
            host["B"] = replayed("B", remat)
    fwd = [s.forward_s for s in stages]
    if schedule.split_backward:
        inp, wgt = split_seconds(stages, remat)
        timeline = schedule.simulate(fwd, [b + w for b, w in zip(inp, wgt)], weight_cost=wgt, host_share=host)
    else:
        bwd = [s.backward_s + (s.forward_s if r else 0.0) for s, r in zip(stages, remat)]
        timeline = schedule.simulate(fwd, bwd, host_share=host)
    busy = sum(timeline.busy(d) for d in range(schedule.num_devices))
    total = schedule.num_devices * timeline.makespan
    return timeline.makespan, (total - busy) / total if total > 0 else 0.0, timeline


def split_seconds(stages: Sequence[StageCost], remat: Sequence[bool]) -> tuple[list[float], list[float]]:
    """Each stage's B and W seconds under a split schedule, as the engine runs them: a
    re-materialized stage's B replays its forward, and its W reads that replay, but on the
    first stage, which has no B: its W replays the stage."""
    inp, wgt = [], []
    for i, (s, r) in enumerate(zip(stages, remat)):
        inp.append(s.input_grad_s + (s.forward_s if r and i > 0 else 0.0))
        wgt.append(s.weight_grad_s + s.forward_s if r and i == 0 else s.kept_weight_grad_s)
    return inp, wgt


def static_bytes(stage: StageCost, optimizer_slots: int, num_micro_batches: int) -> float:
    """Weights, their optimizer slots and their gradient sums (fit keeps a sum per trainable
    weight when M > 1; with M = 1 the gradients, as many bytes, live until the update), and
    with sums the constants that zero them (``StageCost.sum_zeros_bytes``)."""
    zeros = stage.sum_zeros_bytes if num_micro_batches > 1 else 0.0
    parts = sum(size for _, size, _ in stage.borrowed)  # its part of a shared weight's gradient
    return stage.trainable_bytes * (2 + optimizer_slots) + stage.non_trainable_bytes + zeros + parts


def _copies(schedule: Schedule, stages: Sequence[StageCost]) -> list[float]:
    """Per device, the copies it keeps of shared weights another device holds: one each,
    however many of its stages read it."""
    found: list[dict[int, float]] = [{} for _ in range(schedule.num_devices)]
    for i, s in enumerate(stages):
        d = schedule.device_of(i)
        for w, size, owner in s.borrowed:
            if schedule.device_of(owner) != d:
                found[d][w] = size
    return [sum(f.values()) for f in found]


def _events(
    schedule: Schedule, stages: Sequence[StageCost], remat: Sequence[bool]
) -> dict[int, list[tuple[Action, float, float, float]]]:
    """Per device, for each action in its order: (action, bytes held while it runs, the most it
    adds for a moment (its layers' peaks: outputs, gradients, buffers), bytes held after it)."""
    split = schedule.split_backward
    release = "W" if split else "B"
    out: dict[int, list[tuple[Action, float, float, float]]] = {}
    for d, actions in enumerate(schedule.orders):
        live = _initial(schedule, stages, d)
        rows = []
        for a in actions:
            s = stages[a.stage]
            # What a forward leaves until its backward; stage 0's inputs are counted up front.
            stash = s.input_bytes if remat[a.stage] else s.activation_bytes
            arrives = 0.0 if a.stage == 0 else s.input_bytes
            if a.stage == 0:
                stash -= s.input_bytes
            # A split B leaves its W what the W reads (a re-materialized stage's, of its replay).
            halved = split and a.stage > 0
            if a.kind == "F":
                held = live + arrives
                spike = s.forward_bytes if remat[a.stage] else s.taped_forward_bytes
                live += stash
            else:
                # Its own stash is part of what the backward holds (re-built, with remat).
                own = stash + (s.input_bytes if a.stage == 0 else 0.0)
                held = live - own + s.activation_bytes
                peak = s.backward_bytes
                if halved and a.kind == "W":  # it reads what is held already
                    own, held = s.weight_half_bytes, live
                if split and a.kind == "B":
                    if a.stage == 0:  # nothing to compute: no replay, no gradients
                        held, peak = live, s.activation_bytes
                    else:
                        peak = s.taped_input_grad_bytes
                spike = max(peak - s.activation_bytes, 0.0)
                if split:  # the gradient a B received is kept for its W
                    live += s.output_bytes if a.kind == "B" else -s.output_bytes
                if halved and a.kind == "B":
                    live += s.weight_half_bytes - own
                if a.kind == release:
                    live -= own
            rows.append((a, held, spike, live))
        out[d] = rows
    return out


def _update(
    schedule: Schedule, stages: Sequence[StageCost], update: UpdateCost | None, optimizer_slots: int
) -> list[float]:
    """Per device, what the optimizer update allocates beside the static bytes."""
    cost = UpdateCost.estimate(optimizer_slots) if update is None else update
    out = [0.0] * schedule.num_devices
    for i, s in enumerate(stages):
        out[schedule.device_of(i)] += cost.bytes(s.trainable_bytes, schedule.num_micro_batches)
    return out


def device_memory(
    schedule: Schedule,
    stages: Sequence[StageCost],
    remat: Sequence[bool],
    optimizer_slots: int,
    update: UpdateCost | None = None,
) -> list[float]:
    """Predicted peak bytes per device: static bytes of its stages plus the larger of its
    activation peak and its optimizer update's temporaries (``update``; default
    :meth:`UpdateCost.estimate`)."""
    static = _copies(schedule, stages)
    for i, s in enumerate(stages):
        static[schedule.device_of(i)] += static_bytes(s, optimizer_slots, schedule.num_micro_batches)
    events = _events(schedule, stages, remat)
    updates = _update(schedule, stages, update, optimizer_slots)
    return [
        static[d] + max(max((held + spike for _, held, spike, _ in events[d]), default=0.0), updates[d])
        for d in events
    ]


def process_peak(
    schedule: Schedule,
    stages: Sequence[StageCost],
    remat: Sequence[bool],
    optimizer_slots: int,
    timeline: Timeline | None = None,
    update: UpdateCost | None = None,
) -> float:
    """Predicted peak bytes of all devices together, on the simulated timeline.

    For one allocator shared by every device (logical CPUs). What an action holds
    (stashes, the activations of the micro-batch it runs) is summed over the devices
    at each instant; of the momentary peaks (a layer's gradient buffers: a CPU
    convolution's backward takes up to 32 MiB for a few milliseconds) only the largest
    of the actions running then is added: a stage's action lasts many such moments,
    and the peaks of different devices seldom meet. The optimizer update (one function
    for every device's weights) comes after every backward: all of its temporaries at once.
    At most the sum of :func:`device_memory`.
    """
    if timeline is None:  # one allocator: logical CPUs, which share the host's processors too
        timeline = step_time(schedule, stages, remat, shared_host=True)[2]
    static = sum(static_bytes(s, optimizer_slots, schedule.num_micro_batches) for s in stages)
    static += sum(_copies(schedule, stages))
    # (time, ends first, device, bytes held from then on, momentary peak from then on)
    changes: list[tuple[float, int, int, float, float]] = []
    for d, rows in _events(schedule, stages, remat).items():
        changes.append((0.0, 0, d, _initial(schedule, stages, d), 0.0))
        for a, held, spike, after in rows:
            slot = timeline.slots[a]
            changes.append((slot.start, 1, d, held, spike))
            changes.append((slot.end, 0, d, after, 0.0))
    held_now: dict[int, float] = {}
    spike_now: dict[int, float] = {}
    peak = 0.0
    for _, _, d, value, spike in sorted(changes, key=lambda c: (c[0], c[1])):
        held_now[d], spike_now[d] = value, spike
        peak = max(peak, sum(held_now.values()) + max(spike_now.values()))
    return static + max(peak, sum(_update(schedule, stages, update, optimizer_slots)))


def _initial(schedule: Schedule, stages: Sequence[StageCost], d: int) -> float:
    """Stage 0's inputs are the split mini-batch: every micro-batch is there from the start."""
    return schedule.num_micro_batches * stages[0].input_bytes if d == schedule.device_of(0) else 0.0
