"""The fill-drain schedule as data."""

from tf_gpipe.schedule import bubble_fraction, clock_cycles, draw


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
            ticks = clock_cycles(M, K)
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


def test_bubble_and_drawing():
    assert bubble_fraction(1, 4) == 3 / 4
    assert bubble_fraction(16, 4) == 3 / 19
    assert draw(3, 2) == "stage 0: F0 F1 F2 . \nstage 1: .  F0 F1 F2"
