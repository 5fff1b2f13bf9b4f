"""Pipeline schedules as data: completeness, dependencies, timing, pictures, errors."""

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from schedule_orders import copy as _copy
from schedule_orders import parse as _parse

from tf_gpipe import schedules
from tf_gpipe.schedules import (
    Action,
    bubble_fraction,
    clock_cycles,
    get,
    gpipe,
    interleaved,
    one_f_one_b,
)


def _grid():
    """Every (constructor name, K, M, v) the tests sweep."""
    for K in range(1, 7):
        for M in range(1, 13):
            yield "gpipe", K, M, 1
            yield "1f1b", K, M, 1
            yield "zb-h1", K, M, 1
            if M % K == 0:
                for v in range(1, 4):
                    yield "interleaved", K, M, v


def test_package_imports_without_tensorflow():
    # tensorflow, keras and numpy are made unimportable, and tf_gpipe/__init__.py (which
    # pulls TensorFlow in) is replaced by a bare package, so every module of
    # tf_gpipe.schedules must load, and schedules be built and drawn, without them.
    package_dir = Path(schedules.__file__).parent
    code = (
        "import importlib, pkgutil, sys, types\n"
        "for name in ('tensorflow', 'keras', 'numpy'):\n"
        "    sys.modules[name] = None  # import raises ImportError\n"
        "bare = types.ModuleType('tf_gpipe')\n"
        f"bare.__path__ = [{str(package_dir.parent)!r}]\n"
        "sys.modules['tf_gpipe'] = bare\n"
        "import tf_gpipe.schedules as s\n"
        "for info in pkgutil.iter_modules(s.__path__):\n"
        "    importlib.import_module('tf_gpipe.schedules.' + info.name)\n"
        "for name in s.SCHEDULES:\n"
        "    s.get(name, 2, 4, 2 if name == 'interleaved' else 1).draw()\n"
        "print(sorted(info.name for info in pkgutil.iter_modules(s.__path__)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # The probe walked the package's modules (not an empty or stale path).
    assert {"builders", "schedule"} <= set(ast.literal_eval(result.stdout.strip()))


def test_action_labels():
    a = Action("B", 2, 7)
    assert str(a) == "B7"
    assert repr(a) == "B7@s2"
    assert repr([Action("F", 0, 1)]) == "[F1@s0]"


def test_every_schedule_is_complete_and_consistent():
    for name, K, M, v in _grid():
        s = get(name, K, M, v)
        s.validate()
        assert (s.num_devices, s.num_micro_batches, s.virtual_stages) == (K, M, v)
        assert s.num_virtual_stages == K * v
        counts = Counter(a for order in s.orders for a in order)
        expected = {Action(kind, st, m) for kind in s.kinds for st in range(K * v) for m in range(M)}
        assert s.kinds == ("FBW" if name == "zb-h1" else "FB")
        assert set(counts) == expected and set(counts.values()) == {1}, (name, K, M, v)
        for d, order in enumerate(s.orders):
            assert all(s.device_of(a.stage) == d for a in order)

        topo = s.topological_order()
        where = {a: i for i, a in enumerate(topo)}
        assert len(where) == len(topo) == len(expected)
        for a in topo:
            assert all(where[dep] < where[a] for dep in s.dependencies(a)), (name, a)
        for order in s.orders:
            assert [where[a] for a in order] == sorted(where[a] for a in order)


def test_dependencies_and_placement():
    s = interleaved(2, 2, 2)  # 4 stages: device 0 holds 0 and 2, device 1 holds 1 and 3
    assert [s.device_of(st) for st in range(4)] == [0, 1, 0, 1]
    assert s.dependencies(Action("F", 0, 1)) == []
    assert s.dependencies(Action("F", 2, 1)) == [Action("F", 1, 1)]
    assert s.dependencies(Action("B", 3, 0)) == [Action("F", 3, 0)]
    assert s.dependencies(Action("B", 1, 0)) == [Action("F", 1, 0), Action("B", 2, 0)]


def test_gpipe_bubble_is_exactly_the_closed_form():
    for K in range(1, 7):
        for M in range(1, 13):
            s = gpipe(K, M)
            assert s.bubble_fraction(1, 2) == (K - 1) / (M + K - 1)
            assert s.simulate(1, 2).makespan == 3 * (M + K - 1)


def test_1f1b_matches_gpipe_time():
    for K in range(1, 7):
        for M in range(1, 13):
            g, o = gpipe(K, M), one_f_one_b(K, M)
            assert o.simulate().makespan == g.simulate().makespan
            assert o.bubble_fraction() == g.bubble_fraction()


def test_interleaved_shrinks_the_bubble():
    for K in range(2, 7):
        for M in range(K, 13, K):
            base = one_f_one_b(K, M).bubble_fraction()
            for v in (2, 3):
                bubble = interleaved(K, M, v).bubble_fraction()
                assert bubble < base, (K, M, v)
                assert bubble == pytest.approx((K - 1) / (v * M + K - 1), abs=0.02)


def test_interleaved_with_one_chunk_is_1f1b():
    for K in range(1, 5):
        for M in range(K, 13, K):
            assert interleaved(K, M, 1).orders == one_f_one_b(K, M).orders


def test_interleaved_order_follows_megatron():
    # K=2, v=2: virtual micro-batches run K per chunk (F0 F1 on chunk 0, then
    # on chunk 1); device 0 warms up with 2(K-1) + (v-1)K = 4 forwards, device 1
    # with 2; backwards visit the last chunk first.
    s = interleaved(2, 4, 2)
    assert s.orders[0] == _parse(
        "F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 B0@s2 F3@s0 B1@s2 F2@s2 B0@s0 F3@s2 B1@s0 B2@s2 B3@s2 B2@s0 B3@s0"
    )
    assert s.orders[1] == _parse(
        "F0@s1 F1@s1 F0@s3 B0@s3 F1@s3 B1@s3 F2@s1 B0@s1 F3@s1 B1@s1 F2@s3 B2@s3 F3@s3 B3@s3 B2@s1 B3@s1"
    )


def test_peak_in_flight():
    for K in range(1, 7):
        for M in range(1, 13):
            assert gpipe(K, M).peak_in_flight() == [M] * K
            assert one_f_one_b(K, M).peak_in_flight() == [min(M, K - d) for d in range(K)]
    # Interleaving trades memory for bubble: 2(K-d-1) + (v-1)K + 1 stashed.
    assert interleaved(4, 8, 2).peak_in_flight() == [11, 9, 7, 5]


def test_simulate_with_stage_costs_and_communication():
    t = gpipe(2, 1).simulate(forward_cost=[1, 3], backward_cost=[2, 4], comm_cost=0.5)
    F0, F1 = Action("F", 0, 0), Action("F", 1, 0)
    B0, B1 = Action("B", 0, 0), Action("B", 1, 0)
    assert t.slots[F0] == (0, 0, 1)
    assert t.slots[F1] == (1, 1.5, 4.5)  # waits for the activation to arrive
    assert t.slots[B1] == (1, 4.5, 8.5)  # same device as its forward: no transfer
    assert t.slots[B0] == (0, 9.0, 11.0)
    assert t.makespan == 11.0
    assert t.busy(0) == 3 and t.busy(1) == 7


def test_simulate_devices_sharing_one_host():
    """Logical CPUs share the host's processors: while the running actions' shares sum to
    D > 1, each one's processor work runs D times slower."""
    s = gpipe(2, 2)
    alone = s.simulate(1.0, 2.0)
    # Shares that never sum past one slow nothing.
    assert s.simulate(1.0, 2.0, host_share=0.5).slots == alone.slots
    # Every action all processor work: one action's worth at a time, the work in series.
    serial = s.simulate(1.0, 2.0, host_share=1.0)
    assert serial.makespan == pytest.approx(2 * 2 * (1.0 + 2.0))
    F0, F1 = Action("F", 0, 1), Action("F", 1, 0)  # they start together at t = 1
    assert serial.slots[F0] == pytest.approx((0, 1.0, 3.0))
    assert serial.slots[F1] == pytest.approx((1, 1.0, 3.0))
    assert alone.slots[F1] == (1, 1.0, 2.0)


def test_simulate_host_share_segments_run_in_order():
    """Per kind and stage, an action's layers as (time fraction, share) segments: two
    forwards that start together slow each other only where their processor work meets."""
    s = gpipe(2, 2)
    first, last = [(1.0, 1.0), (1.0, 0.0)], [(1.0, 0.0), (1.0, 1.0)]
    back = [[(1.0, 0.0)]] * 2
    met = s.simulate(2.0, 2.0, host_share={"F": [first, first], "B": back})
    apart = s.simulate(2.0, 2.0, host_share={"F": [first, last], "B": back})
    F0, F1 = Action("F", 0, 1), Action("F", 1, 0)  # start together at t = 2
    # Both compute first: 1 s of work each at half speed, then 1 s of waiting.
    assert met.slots[F0] == pytest.approx((0, 2.0, 5.0)) and met.slots[F1] == pytest.approx((1, 2.0, 5.0))
    # One computes while the other waits: neither is slowed.
    assert apart.slots[F0] == pytest.approx((0, 2.0, 4.0)) and apart.slots[F1] == pytest.approx((1, 2.0, 4.0))
    with pytest.raises(ValueError, match="host_share"):
        s.simulate(host_share=1.5)


def test_draw_gpipe():
    # Device d starts forward m at time m+d; the last device turns around at
    # M+K-1 = 6 and every backward waits for the one below it: 2 units apart.
    assert gpipe(3, 4).draw() == (
        "dev 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3\n"
        "dev 1: .  F0 F1 F2 F3 .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 .  .\n"
        "dev 2: .  .  F0 F1 F2 F3 B0 B0 B1 B1 B2 B2 B3 B3 .  .  .  ."
    )


def test_draw_1f1b():
    # Warm-up of 2, 1, 0 forwards, then F/B alternate; same 18 units as GPipe.
    assert one_f_one_b(3, 4).draw() == (
        "dev 0: F0 F1 F2 .  .  .  .  B0 B0 F3 B1 B1 .  B2 B2 .  B3 B3\n"
        "dev 1: .  F0 F1 .  .  B0 B0 F2 B1 B1 F3 B2 B2 .  B3 B3 .  .\n"
        "dev 2: .  .  F0 B0 B0 F1 B1 B1 F2 B2 B2 F3 B3 B3 .  .  .  ."
    )


def test_draw_interleaved():
    # 27 units = (v*M + K - 1) * 3: a bubble of 3 per device against 24 busy.
    # Labels carry the stage since each device runs two of them.
    assert interleaved(2, 4, 2).draw() == (
        "dev 0: F0@s0 F1@s0 F0@s2 F1@s2 F2@s0 .     B0@s2 B0@s2 F3@s0 B1@s2 B1@s2 "
        "F2@s2 B0@s0 B0@s0 F3@s2 B1@s0 B1@s0 .     B2@s2 B2@s2 .     B3@s2 B3@s2 "
        "B2@s0 B2@s0 B3@s0 B3@s0\n"
        "dev 1: .     F0@s1 F1@s1 F0@s3 B0@s3 B0@s3 F1@s3 B1@s3 B1@s3 F2@s1 B0@s1 "
        "B0@s1 F3@s1 B1@s1 B1@s1 F2@s3 B2@s3 B2@s3 F3@s3 B3@s3 B3@s3 B2@s1 B2@s1 "
        "B3@s1 B3@s1 .     ."
    )


def test_validate_catches_deadlock():
    s = one_f_one_b(2, 2)
    # Device 0 goes for B0 before device 1 can produce it, while device 1
    # waits on F1, which device 0 only runs after B0.
    broken = _copy(s, [_parse("F0@s0 B0@s0 F1@s0 B1@s0"), _parse("F1@s1 F0@s1 B0@s1 B1@s1")])
    message = (
        "deadlocks after 1 of 8 actions: device 0 is stuck at B0@s0 waiting for "
        "B0@s1; device 1 is stuck at F1@s1 waiting for F1@s0"
    )
    with pytest.raises(ValueError, match=message):
        broken.validate()
    with pytest.raises(ValueError, match="deadlocks"):
        broken.topological_order()
    with pytest.raises(ValueError, match="deadlocks"):
        broken.simulate()


def test_validate_catches_swapped_gpipe_order():
    s = gpipe(3, 2)
    orders = [list(o) for o in s.orders]
    orders[1][2], orders[1][3] = orders[1][3], orders[1][2]  # B1 before B0 on device 1
    _copy(s, orders).validate()  # reordering alone is fine ...
    orders[1][0], orders[1][2] = orders[1][2], orders[1][0]  # ... a B before its F is not
    with pytest.raises(ValueError, match=r"device 1 is stuck at B1@s1 waiting for F1@s1"):
        _copy(s, orders).validate()


def test_validate_catches_missing_duplicate_misplaced_and_unknown():
    s = gpipe(2, 3)
    orders = [list(o) for o in s.orders]
    with pytest.raises(ValueError, match=r"'gpipe' is missing actions: B2@s0$"):
        _copy(s, [orders[0][:-1], orders[1]]).validate()
    with pytest.raises(ValueError, match=r"F0@s0 is duplicated \(on device 0 and device 0\)"):
        _copy(s, [orders[0] + [Action("F", 0, 0)], orders[1]]).validate()
    with pytest.raises(ValueError, match=r"F0@s1 is on device 0 but stage 1 lives on device 1"):
        _copy(s, [orders[0] + orders[1][:1], orders[1][1:]]).validate()
    with pytest.raises(ValueError, match=r"unknown action F3@s0"):
        _copy(s, [orders[0] + [Action("F", 0, 3)], orders[1]]).validate()
    with pytest.raises(ValueError, match=r"has 1 device orders, expected num_devices=2"):
        _copy(s, orders[:1]).validate()


def test_get_and_errors():
    assert get("gpipe", 3, 4).orders == gpipe(3, 4).orders
    assert get("1f1b", 3, 4).name == "1f1b"
    assert get("interleaved", 2, 4, 2).num_virtual_stages == 4
    with pytest.raises(
        ValueError, match=r"unknown schedule 'zb'; valid names: 'gpipe', '1f1b', 'interleaved', 'zb-h1'$"
    ):
        get("zb", 2, 4)
    with pytest.raises(ValueError, match=r"virtual_stages must be 1, got 2 \(use 'interleaved'"):
        get("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match=r"multiple of num_devices \(4\): use 4 or 8 micro-batches"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match=r"num_micro_batches \(3\).*use 4 micro-batches"):
        interleaved(4, 3, 2)
    with pytest.raises(ValueError, match=r"num_devices must be a positive integer, got 0"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match=r"virtual_stages must be a positive integer"):
        interleaved(2, 4, 0)
    with pytest.raises(
        ValueError, match=r"forward_cost has 2 entries, expected one per stage \(num_virtual_stages=4\)"
    ):
        interleaved(2, 4, 2).simulate(forward_cost=[1, 2])
    with pytest.raises(ValueError, match="integer costs"):
        gpipe(2, 2).draw(forward_cost=1.5)


def test_clock_cycles_picture():
    # t  (m,k) (m,k) (m,k)
    # 0  (0,0)
    # 1  (1,0) (0,1)
    # 2  (2,0) (1,1) (0,2)
    # 3        (2,1) (1,2)
    # 4              (2,2)
    assert clock_cycles(3, 3) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(2, 1), (1, 2)],
        [(2, 2)],
    ]


def test_every_task_once_and_dependencies_respected():
    for M in range(1, 7):
        for K in range(1, 6):
            ticks = clock_cycles(K, M)
            assert len(ticks) == M + K - 1
            when = {task: t for t, tick in enumerate(ticks) for task in tick}
            assert sorted(when) == [(m, k) for m in range(M) for k in range(K)]
            for (m, k), t in when.items():
                if k > 0:
                    assert when[(m, k - 1)] < t  # input ready
                if m > 0:
                    assert when[(m - 1, k)] < t  # one task per device per tick
            for tick in ticks:
                assert len({k for _, k in tick}) == len(tick)


def test_gpipe_bubble_formula():
    assert bubble_fraction(4, 1) == 3 / 4
    assert bubble_fraction(4, 16) == 3 / 19  # num_devices first, as in every schedule builder
    assert bubble_fraction(num_devices=4, num_micro_batches=16) == gpipe(4, 16).bubble_fraction(1, 2)
