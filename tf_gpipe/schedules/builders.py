"""The named schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1) as device orders, and ``get``.

Also fill-drain in closed form: ``clock_cycles`` (its forward ticks, to picture it) and
``bubble_fraction``. Free of TensorFlow.
"""

from __future__ import annotations

from tf_gpipe.schedules.schedule import Action, Schedule

__all__ = [
    "SCHEDULES",
    "bubble_fraction",
    "clock_cycles",
    "get",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "zb_h1",
]


def _check_sizes(num_devices: int, num_micro_batches: int, virtual_stages: int = 1) -> None:
    sizes = {"num_devices": num_devices, "num_micro_batches": num_micro_batches}
    sizes["virtual_stages"] = virtual_stages
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _build(name: str, K: int, M: int, v: int, orders: list[list[Action]], split: bool = False) -> Schedule:
    schedule = Schedule(name, K, M, v, orders, split)
    # Cheap, and catches a constructor bug here rather than as a hung step.
    schedule.validate()
    return schedule


def gpipe(num_devices: int, num_micro_batches: int) -> Schedule:
    """GPipe fill-drain: each device runs all forwards, then all backwards.

    Args:
      num_devices: pipeline depth ``K`` (one stage per device).
      num_micro_batches: ``M``.

    Returns:
      The schedule; every device stashes all ``M`` micro-batches' activations.
    """
    _check_sizes(num_devices, num_micro_batches)
    M = num_micro_batches
    orders = [
        [Action("F", d, m) for m in range(M)] + [Action("B", d, m) for m in range(M)]
        for d in range(num_devices)
    ]
    return _build("gpipe", num_devices, M, 1, orders)


def one_f_one_b(num_devices: int, num_micro_batches: int) -> Schedule:
    """PipeDream-flush 1F1B: warm-up forwards, alternate one F / one B, cool-down backwards.

    Device ``d`` runs ``K - d - 1`` warm-up forwards (capped at ``M``): just
    enough that the first backward reaches it as the pipe fills, so it never
    holds more than ``K - d`` micro-batches' activations, against ``M`` for GPipe,
    at the same makespan.

    Args:
      num_devices: pipeline depth ``K`` (one stage per device).
      num_micro_batches: ``M``.

    Returns:
      The schedule.
    """
    _check_sizes(num_devices, num_micro_batches)
    K, M = num_devices, num_micro_batches
    return _build("1f1b", K, M, 1, [_one_f_one_b_order(K, M, d) for d in range(K)])


def _one_f_one_b_order(K: int, M: int, d: int, w_lag: int | None = None) -> list[Action]:
    """Device ``d``'s 1F1B order; with ``w_lag`` set, the backward is split and
    the W's, oldest first, run ``w_lag`` B's behind them: none after the first
    ``w_lag`` B's, one after each later B, the last ``w_lag`` at the end."""
    warmup = min(K - d - 1, M)
    order = [Action("F", d, m) for m in range(warmup)]
    weights = 0  # W's placed so far, oldest backward first
    for i in range(M):
        if warmup + i < M:
            order.append(Action("F", d, warmup + i))
        order.append(Action("B", d, i))
        if w_lag is not None and i >= w_lag:
            order.append(Action("W", d, weights))
            weights += 1
    if w_lag is not None:
        order += [Action("W", d, m) for m in range(weights, M)]
    return order


def zb_h1(num_devices: int, num_micro_batches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., ICLR 2024): 1F1B with each backward split into B and W.

    ``B`` (input gradient) is all the previous stage waits for, so it runs in
    1F1B's place and gradients travel down the pipe sooner; ``W`` (weight
    gradient) is needed only by the optimizer update, so it can wait. Device
    ``d`` runs 1F1B's F/B order and puts a W after each B, but its W's (oldest
    first) lag ``d`` B's behind, so its last ``d`` W's run at the end: there
    device ``d`` would otherwise idle while the last gradients travel down to
    device 0, ``d`` B-times in all, which the ``d`` W's fill exactly when W
    takes as long as B. With F = B = W and ``M >= K`` each device idles
    ``K - 1`` units against 1F1B's ``3(K - 1)``: a third of the bubble (in
    general ``(K - 1)(F + B - W)`` when ``W <= min(F, B)``, the paper's figure).

    Memory: a stash lives until its W. Device ``d`` holds 1F1B's ``K - d``
    stashes plus the ``d`` whose W lags: ``min(K, M)`` on every device, which is
    what 1F1B's busiest device, device 0, holds already (same peak per
    pipeline, more on devices ``d > 0``).

    Args:
      num_devices: pipeline depth ``K`` (one stage per device).
      num_micro_batches: ``M``.

    Returns:
      The schedule, with ``split_backward=True``.
    """
    _check_sizes(num_devices, num_micro_batches)
    K, M = num_devices, num_micro_batches
    orders = [_one_f_one_b_order(K, M, d, w_lag=d) for d in range(K)]
    return _build("zb-h1", K, M, 1, orders, split=True)


def interleaved(num_devices: int, num_micro_batches: int, virtual_stages: int) -> Schedule:
    """Megatron-LM interleaved 1F1B: ``v`` model chunks per device.

    Device ``d`` holds stages ``d, d+K, ..., d+(v-1)K``. Its work is a sequence
    of ``v*M`` virtual micro-batches taken in groups of ``K`` micro-batches per
    chunk (chunk 0 for micro-batches 0..K-1, chunk 1 for the same, ..., then
    the next K micro-batches); backwards visit the chunks in reverse. Each
    device runs ``2(K-d-1) + (v-1)K`` warm-up forwards (capped at ``v*M``),
    then alternates one forward and one backward, then drains. The bubble
    shrinks to about ``(K-1)/(v*M+K-1)``. With ``v == 1`` the orders are those
    of :func:`one_f_one_b`.

    Args:
      num_devices: ``K``.
      num_micro_batches: ``M``; must be a multiple of ``K``.
      virtual_stages: ``v``, model chunks per device (stages = ``K*v``).

    Returns:
      The schedule.

    Raises:
      ValueError: if ``M`` is not a multiple of ``K``.
    """
    _check_sizes(num_devices, num_micro_batches, virtual_stages)
    K, M, v = num_devices, num_micro_batches, virtual_stages
    if M % K:
        lower, upper = M - M % K, M - M % K + K
        hint = f"{lower} or {upper}" if lower else f"{upper}"
        raise ValueError(
            f"interleaved schedule needs num_micro_batches ({M}) to be a multiple of "
            f"num_devices ({K}): use {hint} micro-batches, or the '1f1b' schedule"
        )
    total = v * M

    def action(kind: str, d: int, k: int) -> Action:
        # Virtual micro-batch k: groups of K*v, inside a group K per chunk.
        group, offset = divmod(k, K * v)
        chunk = offset // K
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(kind, chunk * K + d, group * K + offset % K)

    orders = []
    for d in range(K):
        if v == 1:  # noqa: SIM108 (each branch carries its reasoning)
            # A single chunk is plain 1F1B; Megatron's formula below would stash
            # twice the activations for nothing.
            warmup = min(K - d - 1, M)
        else:
            # Megatron-LM's count: (v-1)K forwards fill chunks 0..v-2 so that the
            # last chunk's first micro-batch can start; 2(K-d-1) more (not K-d-1)
            # keep the device busy while results and gradients are in transit,
            # which matters once communication costs time. Megatron also runs
            # every forward first when M == K; that only suits its paired
            # send/receive calls: here it would raise memory at no gain in time.
            warmup = min(2 * (K - d - 1) + (v - 1) * K, total)
        order = [action("F", d, k) for k in range(warmup)]
        for i in range(total - warmup):
            order += [action("F", d, warmup + i), action("B", d, i)]
        order += [action("B", d, k) for k in range(total - warmup, total)]
        orders.append(order)
    return _build("interleaved", K, M, v, orders)


def clock_cycles(num_devices: int, num_micro_batches: int) -> list[list[tuple[int, int]]]:
    """Forward tasks ``(micro_batch, stage)`` grouped by clock tick, fill then drain.

    At tick ``t`` stage ``k`` works on micro-batch ``t - k``; so while stage 1
    runs micro-batch 0, stage 0 already runs micro-batch 1::

        # t  (m,k) (m,k) (m,k)          K=3, M=3
        # 0  (0,0)
        # 1  (1,0) (0,1)
        # 2  (2,0) (1,1) (0,2)
        # 3        (2,1) (1,2)
        # 4              (2,2)

    The backward pass runs the same ticks in reverse order.
    """
    K, M = num_devices, num_micro_batches
    return [[(t - k, k) for k in range(max(0, t - M + 1), min(t, K - 1) + 1)] for t in range(M + K - 1)]


def bubble_fraction(num_devices: int, num_micro_batches: int) -> float:
    """Idle share of each device under fill-drain: (K-1)/(M+K-1)."""
    K, M = num_devices, num_micro_batches
    return (K - 1) / (M + K - 1)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def get(name: str, num_devices: int, num_micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name.

    Args:
      name: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``.
      num_devices: ``K``.
      num_micro_batches: ``M``.
      virtual_stages: model chunks per device; only ``"interleaved"`` takes more than 1.

    Returns:
      The schedule.

    Raises:
      ValueError: for an unknown name, or ``virtual_stages != 1`` with a
        non-interleaved schedule.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(repr(n) for n in SCHEDULES)}")
    if name == "interleaved":
        return interleaved(num_devices, num_micro_batches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one stage per device: virtual_stages must be 1, "
            f"got {virtual_stages!r} (use 'interleaved' for virtual stages)"
        )
    build = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[name]
    return build(num_devices, num_micro_batches)
