"""Search stage cuts, K, M, re-materialization and schedule for the fastest step that fits.

Every candidate is priced by ``tf_gpipe.plan.predict`` from the same layer profiles,
so the search costs simulations, not measurements. Cuts come from
``tf_gpipe.balance.solvers.solve_minmax`` twice per candidate: once evening out the
stages' time, once their memory (the time-even cut can overload one device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tf_gpipe import schedules
from tf_gpipe.balance.solvers import solve_minmax
from tf_gpipe.partition import within
from tf_gpipe.plan import predict
from tf_gpipe.plan.profile import ModelProfile

__all__ = ["REMATS", "Candidate", "micro_batch_counts", "search"]

REMATS = ("never", "except_last", "always")


@dataclass
class Candidate:
    """One configuration and its prediction."""

    num_stages: int
    num_micro_batches: int
    schedule: str
    virtual_stages: int
    remat: str
    balance: list[int]
    micro_batch_size: int
    step_s: float
    bubble: float
    peak_bytes: list[float]  # per device
    stages: list[predict.StageCost] = field(repr=False)
    fits: bool = False

    @property
    def max_peak(self) -> float:
        return max(self.peak_bytes)

    def key(self) -> tuple:
        """Faster first; on a tie, less memory, then fewer devices and micro-batches."""
        return (self.step_s, self.max_peak, self.num_stages, self.num_micro_batches)

    def label(self) -> str:
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"K={self.num_stages} M={self.num_micro_batches} {self.schedule}{v} remat={self.remat}"


def micro_batch_counts(global_batch: int, max_micro_batches: int) -> list[int]:
    """Divisors of the global batch and powers of two, up to ``max_micro_batches`` and the batch."""
    top = min(global_batch, max_micro_batches)
    counts = {m for m in range(1, top + 1) if global_batch % m == 0}
    counts.update(2**i for i in range(int(math.log2(top)) + 1))
    return sorted(counts)


def remat_flags(remat: str, num_stages: int) -> list[bool]:
    """Whether each stage is re-materialized (``"except_last"``: every stage but the last)."""
    return [remat == "always" or (remat == "except_last" and s < num_stages - 1) for s in range(num_stages)]


def _cuts(profile: ModelProfile, stages: int, n: int, remat: str, slots: int) -> list[list[int]]:
    """Time-even and memory-even cuts (deduplicated), each stage beginning at one of the
    profile's ``cuts`` where that many stages can."""
    profiles = profile.layers
    cuts = within(profile.cuts, stages)
    again = 2.0 if remat == "always" else 1.0  # a replayed forward, for the time cut
    time = [again * p.forward_s.at(n) + p.backward_s.at(n) for p in profiles]
    weights = [float(p.trainable_bytes) for p in profiles]
    for at, size in profile.shared:  # counted once, by its last use: where the step keeps it
        for i in at[:-1]:
            weights[i] -= size
    memory = [
        w * (2 + slots) + p.non_trainable_bytes + p.saved_bytes.at(n) + p.output_bytes.at(n)
        for w, p in zip(weights, profiles)
    ]
    found: list[list[int]] = []
    for costs in (time, memory):
        cut = solve_minmax(costs, stages, cuts)
        if cut not in found:
            found.append(cut)
    return found


def _schedule(name: str, K: int, M: int, v: int, cache: dict) -> schedules.Schedule | None:
    key = (name, K, M, v)
    if key not in cache:
        try:
            cache[key] = schedules.get(name, K, M, v)
        except ValueError:  # e.g. interleaved with M not a multiple of K
            cache[key] = None
    return cache[key]


def search(
    profile: ModelProfile,
    num_devices: Sequence[int],
    global_batch: int,
    memory_budget_bytes: float,
    *,
    optimizer_slots: int = 2,
    schedule_names: Sequence[str] = ("gpipe", "1f1b"),
    remats: Sequence[str] = REMATS,
    max_micro_batches: int = 64,
    virtual_stages: int = 2,
    update: predict.UpdateCost | None = None,
    shared_host: bool = False,
) -> list[Candidate]:
    """Every candidate configuration, priced, fastest first; ``fits`` marks those within budget.

    Args:
        profile: the layers' profiles (``profile_layers``).
        num_devices: the values of K to try.
        global_batch: examples per step; micro-batches hold ``ceil(global_batch / M)``.
        memory_budget_bytes: the most any one device may hold.
        optimizer_slots: slot variables per trainable weight (Adam 2, momentum 1, SGD 0).
        schedule_names: schedules to weigh; ``"interleaved"`` uses ``virtual_stages``.
        remats: re-materialization modes to weigh.
        max_micro_batches: the largest M tried.
        update: the optimizer update's temporaries (default estimated from the slots).
        shared_host: the devices share one host's processors (logical CPUs of one machine).
    """
    cache: dict = {}
    seen = set()
    profiles = profile.layers
    out: list[Candidate] = []
    for K in num_devices:
        for M in micro_batch_counts(global_batch, max_micro_batches):
            n = -(-global_batch // M)
            for name in schedule_names:
                v = virtual_stages if name == "interleaved" else 1
                if K * v > len(profiles) or (K == 1 and name != "gpipe"):
                    continue  # one device: every schedule is the same sequence
                schedule = _schedule(name, K, M, v, cache)
                if schedule is None:
                    continue
                for remat in remats:
                    flags = remat_flags(remat, K * v)
                    for balance in _cuts(profile, K * v, n, remat, optimizer_slots):
                        signature = (name, v, M, tuple(flags), tuple(balance))
                        if signature in seen:  # e.g. "except_last" is "never" on one stage
                            continue
                        seen.add(signature)
                        stages = predict.stage_costs(profile, balance, n)
                        step, bubble, _ = predict.step_time(schedule, stages, flags, shared_host)
                        peaks = predict.device_memory(schedule, stages, flags, optimizer_slots, update)
                        out.append(Candidate(K, M, name, v, remat, balance, n, step, bubble, peaks, stages))
    for c in out:
        c.fits = c.max_peak <= memory_budget_bytes
    out.sort(key=Candidate.key)
    return out
