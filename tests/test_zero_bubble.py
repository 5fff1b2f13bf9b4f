"""Zero-bubble ZB-H1 as data: split backward (B, W), dependencies, bubble, stashes, picture."""

from collections import Counter

import pytest
from schedule_orders import copy as _copy
from schedule_orders import parse as _parse

from tf_gpipe import timeline
from tf_gpipe.schedules import Action, get, gpipe, one_f_one_b, zb_h1

# The grid of the issue: K in {2, 4, 8}, M in {K, 2K, 4K}.
GRID = [(K, M) for K in (2, 4, 8) for M in (K, 2 * K, 4 * K)]


def _idle(schedule, f, b, w):
    """Idle time per device (the same on every device for these schedules) with F=f, B=b, W=w."""
    t = schedule.simulate(f, b + w, weight_cost=w)
    return [t.makespan - t.busy(d) for d in range(schedule.num_devices)]


def test_zb_h1_has_f_b_and_w_once_each():
    for K in range(1, 7):
        for M in range(1, 13):
            s = get("zb-h1", K, M)
            assert s.name == "zb-h1" and s.split_backward and s.kinds == "FBW"
            counts = Counter(a for order in s.orders for a in order)
            expected = {Action(k, st, m) for k in "FBW" for st in range(K) for m in range(M)}
            assert set(counts) == expected and set(counts.values()) == {1}, (K, M)
            topo = s.topological_order()
            where = {a: i for i, a in enumerate(topo)}
            for a in topo:
                assert all(where[dep] < where[a] for dep in s.dependencies(a)), (K, M, a)
    # The other schedules keep one full backward per (stage, micro-batch) and no W.
    for name in ("gpipe", "1f1b"):
        s = get(name, 3, 4)
        assert not s.split_backward and s.kinds == "FB"
        assert {a.kind for order in s.orders for a in order} == {"F", "B"}


def test_zb_h1_keeps_1f1b_forward_and_backward_order():
    # Only the W's are new: drop them and each device runs 1F1B's order.
    for K in range(1, 7):
        for M in range(1, 13):
            zb, base = zb_h1(K, M), one_f_one_b(K, M)
            assert [[a for a in o if a.kind != "W"] for o in zb.orders] == base.orders, (K, M)


def test_split_dependencies():
    s = zb_h1(3, 2)
    assert s.dependencies(Action("W", 1, 0)) == [Action("B", 1, 0)]
    assert s.dependencies(Action("B", 1, 0)) == [Action("F", 1, 0), Action("B", 2, 0)]
    assert s.dependencies(Action("B", 2, 1)) == [Action("F", 2, 1)]
    assert s.dependencies(Action("F", 2, 1)) == [Action("F", 1, 1)]


def test_draw_zb_h1():
    # K=4, M=8, F = B = W = 1 unit. Device d idles exactly K-1 = 3 units (the
    # 1F1B picture of the same work idles 9 per device: 33 units against 27):
    # the B's (input gradients only) carry the gradient down one unit per
    # device, and device d's W's lag d B's behind, so its last d W's fill the
    # end, while device 0, which the last gradients reach last, does not wait.
    assert zb_h1(4, 8).draw() == (
        "dev 0: F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7\n"
        "dev 1: .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7\n"
        "dev 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7\n"
        "dev 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    )


def test_draw_with_a_cheaper_weight_gradient():
    # backward 3 units = B 2 + W 1, so each kind shows for its own length. Device 1
    # turns each micro-batch around at once; device 0's B1 waits for B1@s1 (ends
    # at 7), so its W0 fills the wait and device 1's lagging W0, W1 fill the end.
    picture = zb_h1(2, 2).draw(forward_cost=1, backward_cost=3, weight_cost=1)
    assert picture.split("\n") == [
        "dev 0: F0 F1 .  .  B0 B0 W0 B1 B1 W1",
        "dev 1: .  F0 B0 B0 F1 B1 B1 W0 W1 .",
    ]
    with pytest.raises(ValueError, match="integer costs"):
        zb_h1(2, 2).draw(backward_cost=3)  # W would be 1.5 units


def test_validate_rejects_w_before_its_b():
    s = zb_h1(2, 2)
    orders = [list(o) for o in s.orders]
    i, j = orders[1].index(Action("B", 1, 0)), orders[1].index(Action("W", 1, 0))
    orders[1][i], orders[1][j] = orders[1][j], orders[1][i]
    with pytest.raises(ValueError, match=r"device 1 is stuck at W0@s1 waiting for B0@s1"):
        _copy(s, orders).validate()
    with pytest.raises(ValueError, match="deadlocks"):
        _copy(s, orders).simulate()


def test_validate_rejects_a_b_that_comes_before_the_gradient_can():
    # Device 0 runs B0 before F1; device 1 runs F1 before B0: device 0 waits
    # for B0@s1, which waits for F1@s1, which waits for F1@s0 behind B0@s0.
    s = zb_h1(2, 2)
    broken = _copy(
        s,
        [_parse("F0@s0 B0@s0 F1@s0 W0@s0 B1@s0 W1@s0"), _parse("F0@s1 F1@s1 B0@s1 W0@s1 B1@s1 W1@s1")],
    )
    with pytest.raises(ValueError, match=r"device 0 is stuck at B0@s0 waiting for B0@s1"):
        broken.validate()


def test_validate_rejects_missing_misplaced_and_stray_w():
    s = zb_h1(2, 3)
    orders = [list(o) for o in s.orders]
    without = [[a for a in orders[0] if a != Action("W", 0, 2)], orders[1]]
    with pytest.raises(ValueError, match=r"'zb-h1' is missing actions: W2@s0$"):
        _copy(s, without).validate()
    moved = [orders[0] + [Action("W", 1, 0)], [a for a in orders[1] if a != Action("W", 1, 0)]]
    with pytest.raises(ValueError, match=r"W0@s1 is on device 0 but stage 1 lives on device 1"):
        _copy(s, moved).validate()
    # A W in a schedule whose B is the full backward is unknown, and the error says why.
    base = one_f_one_b(2, 3)
    stray = [base.orders[0] + [Action("W", 0, 0)], base.orders[1]]
    with pytest.raises(
        ValueError, match=r"unknown action W0@s0 \(kind must be 'F' or 'B'.*split_backward=True"
    ):
        _copy(base, stray).validate()


@pytest.mark.parametrize("K,M", GRID)
def test_bubble_zb_h1_below_1f1b_equal_to_gpipe(K, M):
    # F = B = W = 1 (a full backward of 2): zb-h1 < 1f1b; 1f1b and gpipe do the
    # same work in the same time (1F1B saves memory, not time, without transfer costs).
    for w in (1, 0.5):
        zb = zb_h1(K, M).bubble_fraction(1, 1 + w, weight_cost=w)
        f1b = one_f_one_b(K, M).bubble_fraction(1, 1 + w, weight_cost=w)
        gp = gpipe(K, M).bubble_fraction(1, 1 + w, weight_cost=w)
        assert zb < f1b == gp, (K, M, w, zb, f1b, gp)


@pytest.mark.parametrize("K,M", GRID)
def test_zb_h1_idles_a_third_of_1f1b(K, M):
    # The paper's setting F = B = W: each device idles K-1 units against 3(K-1).
    zb, base = _idle(zb_h1(K, M), 1, 1, 1), _idle(one_f_one_b(K, M), 1, 1, 1)
    assert zb == [K - 1] * K and base == [3 * (K - 1)] * K
    # As a fraction of the (shorter) step: (K-1)/(3M+K-1) against (K-1)/(M+K-1).
    assert zb_h1(K, M).bubble_fraction(1, 2, weight_cost=1) == (K - 1) / (3 * M + K - 1)
    assert zb_h1(K, M).simulate(1, 2, weight_cost=1).makespan == 3 * M + K - 1


@pytest.mark.parametrize("f,b,w", [(1, 1, 0.5), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 0)])
def test_zb_h1_bubble_is_the_papers_formula(f, b, w):
    # (K-1)(F+B-W) idle per device whenever W <= min(F, B).
    for K, M in GRID:
        assert _idle(zb_h1(K, M), f, b, w) == pytest.approx([(K - 1) * (f + b - w)] * K), (K, M)


def test_peak_in_flight_counts_a_stash_until_its_w():
    for K in range(1, 7):
        for M in range(1, 13):
            zb, base = zb_h1(K, M).peak_in_flight(), one_f_one_b(K, M).peak_in_flight()
            # The lagging W's raise devices d > 0 to device 0's level, never above it.
            assert zb == [min(K, M)] * K, (K, M)
            assert max(zb) == max(base) and all(z >= b for z, b in zip(zb, base))
    # Counted from the order: device 3 of K=4 holds F0..F3 until W0 runs after B3.
    order = zb_h1(4, 8).orders[3]
    assert order[:8] == _parse("F0@s3 B0@s3 F1@s3 B1@s3 F2@s3 B2@s3 F3@s3 B3@s3")


def test_costs():
    s = zb_h1(2, 4)
    assert s.durations(1, 3, weight_cost=1) == {"F": [1, 1], "B": [2, 2], "W": [1, 1]}
    assert s.durations(1, [2, 4]) == {"F": [1, 1], "B": [1, 2], "W": [1, 2]}  # W: half by default
    # Non-split schedules take the same arguments and spend backward_cost on B.
    assert one_f_one_b(2, 4).durations(1, 3, weight_cost=1) == {"F": [1, 1], "B": [3, 3]}
    assert one_f_one_b(2, 4).simulate(1, 3, weight_cost=1) == one_f_one_b(2, 4).simulate(1, 3)
    # Same costs, same total work: only the idle time differs between schedules.
    busy = [get(n, 2, 4).simulate(1, 3, weight_cost=1).busy(0) for n in ("gpipe", "1f1b", "zb-h1")]
    assert busy == [16, 16, 16]
    with pytest.raises(
        ValueError, match=r"weight_cost \(4\) of stage 0 must lie in \[0, backward_cost \(3\)\]"
    ):
        s.simulate(1, 3, weight_cost=4)
    with pytest.raises(ValueError, match=r"weight_cost has 3 entries, expected one per stage"):
        s.bubble_fraction(1, 2, weight_cost=[1, 1, 1])


def test_get_zb_h1_and_errors():
    assert get("zb-h1", 3, 5).orders == zb_h1(3, 5).orders
    with pytest.raises(ValueError, match=r"'zb-h1' runs one stage per device: virtual_stages must be 1"):
        get("zb-h1", 2, 4, 2)
    with pytest.raises(ValueError, match=r"num_micro_batches must be a positive integer, got 0"):
        zb_h1(2, 0)


def _span(device, kind, m, start, end):
    return timeline.Span(device, kind, device, m, start, end)


def test_live_stashes_release_at_w_when_split():
    # Device 0: F0 F1 B0 B1 W0 W1 holds two stashes until W0, whatever B did.
    split = [
        _span(0, "F", 0, 0, 1),
        _span(0, "F", 1, 1, 2),
        _span(0, "B", 0, 2, 3),
        _span(0, "F", 2, 3, 4),
        _span(0, "W", 0, 4, 5),
    ]
    assert timeline.live_stashes(split) == {0: 3}
    # Without W spans the backward frees the stash, as before.
    full = [s for s in split if s.kind != "W"]
    assert timeline.live_stashes(full) == {0: 2}
