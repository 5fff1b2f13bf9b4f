"""tf_gpipe.timeline: recorded spans follow the schedule; stashes; Chrome trace; Gantt PNG."""

import itertools
import json
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_gpipe
from tf_gpipe import schedules, timeline

K = 4  # conftest.py makes 4 logical CPUs


def _model(schedule, M, remat="always", width=8):
    keras.utils.set_random_seed(0)
    layers = [keras.layers.InputLayer(shape=(6,))]
    layers += [keras.layers.Dense(width, activation="tanh") for _ in range(K - 1)]
    layers += [keras.layers.Dense(3)]
    model = tf_gpipe.PipelineModel(layers, num_stages=K, num_micro_batches=M, remat=remat, schedule=schedule)
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _data(n):
    rng = np.random.RandomState(0)
    return rng.randn(n, 6).astype("float32"), rng.randint(0, 3, n)


def _record_fit(model, n, steps=1):
    x, y = _data(n * steps)
    with timeline.record(model) as rec:
        model.fit(x, y, batch_size=n, epochs=1, shuffle=False, verbose=0)
    got = rec.steps()
    assert len(got) == steps
    return got


def _by_device(spans):
    out = {}
    for sp in sorted(spans, key=lambda s: (s.device, s.start, s.end)):
        out.setdefault(sp.device, []).append((sp.kind, sp.stage, sp.micro_batch))
    return out


@pytest.mark.parametrize("remat", ["always", "never"])
def test_gpipe_spans_follow_schedule_order(remat):
    M = 4
    spans = _record_fit(_model("gpipe", M, remat=remat), n=2 * M, steps=2)[-1]
    plan = schedules.get("gpipe", K, M)
    expected = {}
    for d, order in enumerate(plan.orders):
        row = []
        for a in order:
            if a.kind == "B" and remat == "always":
                row.append(("R", a.stage, a.micro_batch))  # the replay, then the backward proper
            row.append((a.kind, a.stage, a.micro_batch))
        expected[d] = row
    assert _by_device(spans) == expected
    # every micro-batch has its F (R) B on every device, and spans are well formed
    kinds = "FRB" if remat == "always" else "FB"
    for d in range(K):
        for m in range(M):
            for kind in kinds:
                assert sum(1 for s in spans if (s.device, s.kind, s.micro_batch) == (d, kind, m)) == 1
    for s in spans:
        assert 0.0 <= s.start <= s.end
    # a device runs one action at a time
    for d in range(K):
        mine = sorted((s for s in spans if s.device == d), key=lambda s: s.start)
        for a, b in itertools.pairwise(mine):
            assert a.end <= b.start + 1e-6


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zb-h1"])
def test_live_stashes(name):
    M = 8
    spans = _record_fit(_model(name, M), n=M)[-1]
    live = timeline.live_stashes(spans)
    plan = schedules.get(name, K, M)
    if name == "1f1b":
        assert live == {d: K - d for d in range(K)}
        assert max(live.values()) <= K
    elif name == "zb-h1":  # a stash lives until its W: K on every device, never more
        assert live == {d: K for d in range(K)}
    else:
        assert live == {d: M for d in range(K)}
    assert [live[d] for d in range(K)] == plan.peak_in_flight()


@pytest.mark.parametrize("remat", ["always", "never"])
def test_zb_h1_runs_b_and_w_apart_in_schedule_order(remat):
    """Each device runs F, B and W as separate actions, one at a time, in its zb-h1 order.
    Re-materialized, B replays the stage (an R span before it) and W reads that replay;
    stage 0's B computes nothing (its input needs no gradient), so its W replays."""
    M = 8
    spans = _record_fit(_model("zb-h1", M, remat=remat), n=M)[-1]
    plan = schedules.get("zb-h1", K, M)
    expected = {}
    for d, order in enumerate(plan.orders):
        row = []
        for a in order:
            if remat == "always" and a.kind != "F" and (a.kind == "B") == (a.stage > 0):
                row.append(("R", a.stage, a.micro_batch))
            row.append((a.kind, a.stage, a.micro_batch))
        expected[d] = row
    assert _by_device(spans) == expected
    for d in range(K):
        mine = sorted((s for s in spans if s.device == d), key=lambda s: s.start)
        for a, b in itertools.pairwise(mine):
            assert a.end <= b.start + 1e-6, (a, b)


def test_spans_of_1f1b_follow_schedule_order():
    M = 8
    spans = _record_fit(_model("1f1b", M, remat="never"), n=M)[-1]
    plan = schedules.get("1f1b", K, M)
    expected = {d: [(a.kind, a.stage, a.micro_batch) for a in order] for d, order in enumerate(plan.orders)}
    assert _by_device(spans) == expected


def test_save_chrome_trace(tmp_path):
    M = 4
    spans = _record_fit(_model("1f1b", M), n=M)[-1]
    path = tmp_path / "trace.json"
    timeline.save_chrome_trace(spans, str(path), device_names=[f"stage {d}" for d in range(K)])
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(spans)
    for e in complete:
        assert e["name"][0] in "FRB" and e["dur"] >= 0 and e["ts"] >= 0
        assert e["tid"] in range(K)
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {d: f"stage {d}" for d in range(K)}


def test_save_gantt(tmp_path):
    pytest.importorskip("matplotlib")
    M = 4
    spans = _record_fit(_model("gpipe", M), n=M)[-1]
    path = tmp_path / "gantt.png"
    timeline.save_gantt(spans, str(path), title="gpipe K=4 M=4")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 1000


class _Sleep(keras.layers.Layer):
    """Identity whose forward sleeps ``ms`` in a host function (stateless, so tf.function
    does not order it against other host functions)."""

    def __init__(self, ms, **kwargs):
        super().__init__(**kwargs)
        self.ms = ms
        # A host call inside: no XLA (what Keras asks a layer to declare).
        self.supports_jit = False

    def call(self, x):
        def work(v):
            time.sleep(self.ms / 1e3)
            return v

        out = tf.numpy_function(work, [x], Tout=x.dtype, stateful=False)
        out.set_shape(x.shape)
        return x + tf.stop_gradient(out - x)  # the value of out, the gradient of identity


def test_recorded_devices_overlap(cpu_devices):
    M = 4
    keras.utils.set_random_seed(0)
    layers = [keras.layers.InputLayer(shape=(6,))]
    for _ in range(K):
        layers += [_Sleep(20), keras.layers.Dense(6)]
    model = tf_gpipe.PipelineModel(
        layers, devices=cpu_devices[:K], num_micro_batches=M, remat="never", schedule="gpipe"
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.ones((M, 6), "float32")
    with timeline.record(model) as rec:
        model.train_on_batch(x, x)
        model.train_on_batch(x, x)
    spans = rec.steps()[-1]
    fwd = {(s.device, s.micro_batch): s for s in spans if s.kind == "F"}
    # fill-drain: F1 on device 0 runs while F0 runs on device 1 (each sleeps 20 ms)
    a, b = fwd[(0, 1)], fwd[(1, 0)]
    overlap = min(a.end, b.end) - max(a.start, b.start)
    assert overlap > 0.010, (a, b)
