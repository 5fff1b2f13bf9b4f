"""Balancing: per-layer cost estimates, partition solvers, the partition report."""

import itertools
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import tf_gpipe
from tf_gpipe.balance import (
    balance_by,
    by_memory,
    by_params,
    by_time,
    report,
    solve_min_variance,
    solve_minmax,
    stage_costs,
)

SOLVERS = [solve_minmax, solve_min_variance]


def compositions(n, k):
    """Every way to cut n layers into k non-empty consecutive stages."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [b - a for a, b in zip((0,) + cuts, cuts + (n,))]


def valid(balance, n, k):
    # Python ints: PipelineModel's balance check rejects numpy integers.
    python_ints = all(type(b) is int for b in balance)
    return python_ints and len(balance) == k and min(balance) >= 1 and sum(balance) == n


# ---------------------------------------------------------------------- solvers
@settings(max_examples=50, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.data())
def test_solve_minmax_is_optimal_and_most_even(costs, data):
    k = data.draw(st.integers(1, len(costs)), label="num_stages")
    got = solve_minmax(costs, k)
    assert valid(got, len(costs), k)
    options = list(compositions(len(costs), k))
    best = min(max(stage_costs(costs, b)) for b in options)
    assert max(stage_costs(costs, got)) == best  # integers: exact sums
    # Among the optimal partitions, the most even one.
    optimal = [stage_costs(costs, b) for b in options if max(stage_costs(costs, b)) == best]
    squares = [sum(c * c for c in stages) for stages in optimal]
    assert sum(c * c for c in stage_costs(costs, got)) == min(squares)


@settings(max_examples=50, derandomize=True, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=8), st.data())
def test_solve_minmax_is_optimal_for_floats(costs, data):
    k = data.draw(st.integers(1, len(costs)), label="num_stages")
    got = solve_minmax(costs, k)
    assert valid(got, len(costs), k)
    best = min(max(stage_costs(costs, b)) for b in compositions(len(costs), k))
    assert max(stage_costs(costs, got)) == pytest.approx(best, rel=1e-12, abs=1e-12)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=2, max_size=8), st.data())
def test_solve_minmax_cuts_only_where_allowed_and_is_optimal_there(costs, data):
    n = len(costs)
    cuts = data.draw(st.lists(st.integers(1, n - 1), unique=True, max_size=n - 1), label="cuts")
    k = data.draw(st.integers(1, n), label="num_stages")
    options = [b for b in compositions(n, k) if set(np.cumsum(b)[:-1]) <= set(cuts)]
    if not options:
        with pytest.raises(ValueError, match=f"at most {len(cuts) + 1} stages"):
            solve_minmax(costs, k, cuts=cuts)
        return
    got = solve_minmax(costs, k, cuts=cuts)
    assert valid(got, n, k) and set(np.cumsum(got)[:-1]) <= set(cuts)
    best = min(max(stage_costs(costs, b)) for b in options)
    assert max(stage_costs(costs, got)) == best
    if len(cuts) == n - 1:  # every cut allowed: what no cuts gives
        assert got == solve_minmax(costs, k)


def test_solve_minmax_examples():
    assert solve_minmax([1] * 10, 4) == [3, 3, 2, 2]  # ties: like even_balance, remainder first
    assert solve_minmax([1] * 11 + [6], 4) == [4, 4, 3, 1]  # a heavy head gets a stage of its own
    assert solve_minmax([0, 0, 0], 2) == [2, 1]
    assert solve_minmax([5], 1) == [1]


@pytest.mark.parametrize(
    "costs, k, expected",
    [  # torchgpipe.balance.blockpartition.solve gives the same
        ([1, 2, 3, 4, 5, 6], 2, [4, 2]),
        ([6, 5, 4, 3, 2, 1], 2, [2, 4]),
        ([0, 0], 2, [1, 1]),
        ([1, 1, 1, 1, 1], 2, [2, 3]),  # equal costs: n // K a stage, the remainder last
        ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 4, [3, 2, 1, 4]),
        # Stages may differ by one (rescaled) largest layer: the heavy head is not split off.
        ([1] * 11 + [6], 4, [3, 3, 3, 3]),
    ],
)
def test_min_variance_matches_torchgpipe(costs, k, expected):
    assert solve_min_variance(costs, k) == expected


def test_min_variance_never_returns_an_empty_stage():
    # torchgpipe returns [4, 0, 1] here: it moves a layer out of an empty stage.
    assert solve_min_variance([0, 0, 0, 1.958, 2.773], 3) == [1, 3, 1]


@settings(max_examples=50, derandomize=True, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=10), st.data())
def test_min_variance_is_valid_and_never_beats_minmax(costs, data):
    k = data.draw(st.integers(1, len(costs)), label="num_stages")
    got = solve_min_variance(costs, k)
    assert valid(got, len(costs), k)
    assert max(stage_costs(costs, got)) >= max(stage_costs(costs, solve_minmax(costs, k)))


@pytest.mark.parametrize("solve", SOLVERS)
def test_solver_errors(solve):
    with pytest.raises(ValueError, match="empty"):
        solve([], 1)
    with pytest.raises(ValueError, match="greater than the number of layers"):
        solve([1, 2], 3)
    with pytest.raises(ValueError, match=">= 1"):
        solve([1, 2], 0)
    with pytest.raises(ValueError, match="integer"):
        solve([1, 2], 2.0)
    with pytest.raises(ValueError, match=r"costs\[1\] = -1.0"):
        solve([1, -1], 1)
    with pytest.raises(ValueError, match="finite"):
        solve([1, float("nan")], 1)


# ---------------------------------------------------------------------- estimates
def small_layers():
    return [
        keras.layers.Dense(16, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.5, seed=3),
        keras.layers.Dense(4),
    ]


def test_by_params_builds_layers_with_real_shapes():
    layers = small_layers()
    params = by_params(layers, np.random.rand(8, 10).astype("float32"))
    assert all(layer.built for layer in layers)
    assert tuple(layers[0].kernel.shape) == (10, 16)
    assert params == [float(layer.count_params()) for layer in layers] == [176.0, 64.0, 0.0, 68.0]


@pytest.mark.parametrize(
    "make_sample",
    [
        lambda: (8, 10),
        lambda: keras.KerasTensor((None, 10)),
        lambda: tf.TensorSpec((None, 10), tf.float32),
        lambda: np.zeros((3, 10), "float32"),
    ],
)
def test_sample_forms(make_sample):
    layers = small_layers()
    assert by_params(layers, make_sample())[0] == 176.0


def test_sample_from_keras_input_and_int_inputs():
    layers = [
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(50, 8, mask_zero=True),  # its mask reaches the RNN
        keras.layers.SimpleRNN(4),
        keras.layers.Dense(2),
    ]
    assert by_params(layers) == [400.0, 52.0, 10.0]
    assert by_memory(layers, optimizer_slots=0)[0] == 400 * 4 * 2 + 32 * 5 * 8 * 4  # batch_size=32
    assert all(t > 0 for t in by_time(layers, repeats=1, warmup=0))


def test_heavy_layer_ranks_above_light():
    layers = [keras.layers.Dense(512), keras.layers.Dense(4)]
    sample = (256, 512)
    memory = by_memory(layers, sample)
    assert memory[0] == (2 + 2) * 4 * (512 * 512 + 512) + 4 * 256 * 512
    assert memory[0] > memory[1] > 0
    seconds = by_time(layers, sample, repeats=5)
    assert seconds[0] > seconds[1] > 0


class SlowBackward(keras.layers.Layer):
    """The identity, whose gradient sleeps ``ms``: only a timed backward sees its cost."""

    def __init__(self, ms, **kwargs):
        super().__init__(**kwargs)
        self.ms = ms

    def call(self, x):
        @tf.custom_gradient
        def run(x):
            def grad(dy):
                return tf.numpy_function(lambda v: (time.sleep(self.ms / 1e3), v)[1], [dy], dy.dtype)

            return tf.identity(x), grad

        return run(x)


def test_by_time_times_the_backward():
    # Under tf.init_scope (as in building) tapes are paused: only the forward would be timed.
    seconds = by_time([SlowBackward(30.0), keras.layers.Dense(4)], (8, 4), repeats=3, warmup=0)
    assert seconds[0] >= 0.030 > seconds[1]


def test_estimates_leave_no_side_effects():
    layers = small_layers()
    sample = np.random.rand(16, 10).astype("float32")
    by_params(layers, sample)  # builds
    before = [v.numpy().copy() for layer in layers for v in layer.variables]
    by_time(layers, sample, repeats=2, warmup=0)  # training mode: BatchNorm moves, Dropout draws
    by_memory(layers, sample)
    after = [v.numpy() for layer in layers for v in layer.variables]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_sample_errors():
    with pytest.raises(ValueError, match="pass a sample"):
        by_params([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="give every dimension"):
        by_params([keras.layers.Dense(2)], keras.KerasTensor((None, None, 3)))
    with pytest.raises(TypeError, match=r"pass \[layer\]"):
        by_params(keras.layers.Dense(2), (2, 3))
    with pytest.raises(ValueError, match=r"layers\[1\] .*'bad'"):
        by_params([keras.layers.Dense(2), keras.layers.Reshape((5,), name="bad")], (2, 3))


# ---------------------------------------------------------------------- balance_by and report
def test_balance_by_feeds_pipeline_model(cpu_devices):
    layers = [keras.layers.Dense(8, activation="tanh") for _ in range(3)] + [keras.layers.Dense(256)]
    x = np.random.RandomState(0).rand(6, 8).astype("float32")
    for method in ("params", "memory"):
        assert balance_by(method, layers, 2, x) == [3, 1]
    assert balance_by("params", layers, 2, x, solver="min_variance") == [2, 2]  # within one layer
    model = tf_gpipe.PipelineModel(layers, balance=[3, 1], devices=cpu_devices[:2], num_micro_batches=2)
    expected = x
    for layer in layers:  # the same layer objects: the unsplit result
        expected = layer(expected)
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-6)


def test_balance_by_errors():
    with pytest.raises(ValueError, match="unknown balance method 'flops'"):
        balance_by("flops", [keras.layers.Dense(2)], 1, (2, 3))
    with pytest.raises(ValueError, match="unknown solver"):
        balance_by("params", [keras.layers.Dense(2)], 1, (2, 3), solver="greedy")
    with pytest.raises(ValueError, match="greater than the number of layers"):  # before profiling
        balance_by("time", [keras.layers.Dense(2)], 2, None)


def test_report_names_every_layer_and_stage(cpu_devices):
    layers = [keras.layers.Dense(32, name=f"body_{i}") for i in range(5)]
    layers.append(keras.layers.Dense(256, name="head"))
    sample = (16, 32)
    times = [1e-3] * 5 + [4e-3]
    text = report(layers, [3, 2, 1], sample, time_costs=times, devices=cpu_devices[:3], num_micro_batches=4)
    for layer in layers:
        assert layer.name in text
    rows = text.splitlines()[3:6]
    for s, row in enumerate(rows):
        assert row.split()[:2] == [str(s), cpu_devices[s]]
    assert "Stage imbalance (max/mean time): 1.33" in text  # 4 ms against a mean of 3 ms
    assert "bubble" in text and "Predicted step" in text
    # Built layers need no sample; without times the imbalance is by parameters.
    text = report(layers, [5, 1], num_micro_batches=8, schedule="1f1b")
    assert "max/mean params" in text and "head" in text


def test_report_interleaved_and_errors():
    layers = [keras.layers.Dense(4) for _ in range(4)]
    text = report(layers, [1, 1, 1, 1], (2, 4), num_micro_batches=2, schedule="interleaved", virtual_stages=2)
    assert text.count("/device:") == 4
    with pytest.raises(ValueError, match="sums to 3"):
        report(layers, [1, 2], (2, 4))
    with pytest.raises(ValueError, match="time_costs has 2 entries"):
        report(layers, [2, 2], (2, 4), time_costs=[1.0, 2.0])
    with pytest.raises(ValueError, match="pass a sample"):
        report([keras.layers.Dense(3)], [1])
    with pytest.raises(ValueError, match="got 1 devices for 2"):
        report(layers, [2, 2], devices=["/device:CPU:0"])
