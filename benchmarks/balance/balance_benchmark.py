"""Step time of a deliberately imbalanced pipeline: even split vs each tf_gpipe.balance method.

12 layers on K=4 modelled devices: an "embedding" (1 time unit, 12 parameter units), ten
"blocks" (1, 1) and a "head" (5, 3). Each is a ``CostLayer``: a ``SerialWork``
(benchmarks/serial_device.py) whose forward sleeps ``units * unit_ms`` on its stage's device
lock and whose backward sleeps twice that, plus ``1000 * param_units`` weights that cost no
time. Partitions: the even split, ``balance_by("params" | "memory" | "time")`` with
``minmax`` and the time profile with ``min_variance``; each step time is compared with what
``tf_gpipe.schedules`` predicts for it and with the ideal (every stage total / K). Method,
command and results: benchmarks/balance/README.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("stages", 4, "K, pipeline devices.")
flags.DEFINE_list("micro_batches", ["4", "16"], "Values of M.")
flags.DEFINE_float("unit_ms", 6.0, "Forward time of one time unit; a backward costs twice.")
flags.DEFINE_enum("remat", "never", ["never", "always"], "PipelineModel remat mode.")
flags.DEFINE_integer("profile_repeats", 7, "repeats for balance.by_time (median kept).")
flags.DEFINE_integer("warmup", 1, "Untimed train_on_batch calls after the first (tracing) one.")
flags.DEFINE_integer("steps", 5, "Timed rounds: one train_on_batch per configuration each (median kept).")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")

# (name, time units, parameter units)
MODEL = [("embedding", 1, 12)] + [(f"block_{i}", 1, 1) for i in range(10)] + [("head", 5, 3)]
WIDTH = 16  # features of the (identity) activations


def main(argv):
    del argv
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K, unit = FLAGS.stages, FLAGS.unit_ms
    devices = tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_gpipe import balance, schedules
    from tf_gpipe.partition import even_balance

    class CostLayer(sd.SerialWork):
        """SerialWork of ``time_units`` (f = units * unit_ms, b = 2f) with ``1000 * param_units`` weights."""

        def __init__(self, device_index, time_units, param_units, **kwargs):
            super().__init__(device_index, time_units * unit, 2 * time_units * unit, **kwargs)
            self.param_units = param_units

        def build(self, input_shape):
            super().build(input_shape)
            self.table = self.add_weight(shape=(1000 * self.param_units,), initializer="zeros", name="table")

        def call(self, x):  # the weights join the output (times 0) so they get a gradient like any weight
            return super().call(x) + 0.0 * tf.reduce_sum(self.table)

    def layers_for(stage_of):
        return [CostLayer(stage_of(i), t, p, name=name) for i, (name, t, p) in enumerate(MODEL)]

    harness.header("tf_gpipe balance benchmark", extra=["inter_op=64: K sleeping devices never starve TF"])
    profile = layers_for(lambda i: 100 + i)  # own lock each: no waiting
    sample = np.zeros((int(FLAGS.micro_batches[0]), WIDTH), "float32")
    t0 = time.perf_counter()
    costs = {
        "params": balance.by_params(profile, sample),
        "memory": balance.by_memory(profile, sample),
        "time": balance.by_time(profile, sample, repeats=FLAGS.profile_repeats),
    }
    profile_s = time.perf_counter() - t0
    partitions = {
        "even split (layer count)": even_balance(len(MODEL), K),
        "params, minmax": balance.balance_by("params", profile, K, sample),
        "memory, minmax": balance.balance_by("memory", profile, K, sample),
        # Time is profiled once and solved twice (balance_by would profile again).
        "time, minmax": balance.solve_minmax(costs["time"], K),
        "time, min_variance (torchgpipe)": balance.solve_min_variance(costs["time"], K),
    }
    units = [t for _, t, _ in MODEL]
    b_factor = 3 if FLAGS.remat == "always" else 2  # a re-materialized backward replays the forward

    def predicted(stage_units, M):
        fwd = [u * unit for u in stage_units]
        plan = schedules.get("gpipe", K, M)
        return plan.simulate(fwd, [b_factor * f for f in fwd]).makespan, plan.bubble_fraction(
            fwd, [b_factor * f for f in fwd]
        )

    # Build and trace every configuration first, then time them in rounds, one step each per round:
    # the machine's load drifts, and interleaving spreads it evenly over the partitions.
    results, runs = [], []
    rng = np.random.default_rng(0)
    for M in map(int, FLAGS.micro_batches):
        x = tf.constant(rng.standard_normal((M, WIDTH), dtype=np.float32))
        y = tf.constant(rng.standard_normal((M, WIDTH), dtype=np.float32))
        ideal_ms, ideal_bubble = predicted([sum(units) / K] * K, M)
        for method, bal in partitions.items():
            stage_of = [s for s, n in enumerate(bal) for _ in range(n)]
            layers = [keras.Input((WIDTH,)), *layers_for(stage_of.__getitem__)]
            kwargs = dict(balance=bal, devices=devices[:K], num_micro_batches=M, remat=FLAGS.remat)
            model = tf_gpipe.PipelineModel(layers, **kwargs)
            model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
            for _ in range(1 + FLAGS.warmup):  # the first call traces
                model.train_on_batch(x, y)
            stage_units = balance.stage_costs(units, bal)
            pred_ms, bubble = predicted(stage_units, M)
            results.append(dict(M=M, method=method, balance=bal, stage_units=stage_units, bubble=bubble,
                                predicted_ms=pred_ms, ideal_ms=ideal_ms, ideal_bubble=ideal_bubble,
                                times_ms=[]))  # fmt: skip
            runs.append((model, x, y))
    for _ in range(FLAGS.steps):
        for r, (model, x, y) in zip(results, runs):
            t0 = time.perf_counter()
            model.train_on_batch(x, y)  # returns numpy logs: synchronizes
            r["times_ms"].append((time.perf_counter() - t0) * 1e3)

    rows = [
        [name, t, f"{3 * t * unit:.1f}", f"{s * 1e3:.1f}", f"{p:,.0f}", f"{m / 1024:.1f}"]
        for (name, t, _), s, p, m in zip(MODEL, costs["time"], costs["params"], costs["memory"])
    ]
    title = f"## Per-layer estimates (profiled once, {profile_s:.1f} s)"
    harness.print_table("layer|time units|true f+b ms|by_time ms|by_params|by_memory KiB", rows, title)
    rows, notes = [], []
    for M in map(int, FLAGS.micro_batches):
        group = [r for r in results if r["M"] == M]
        even = group[0]
        for r in group:
            r["measured_ms"] = statistics.median(r["times_ms"])
            rows.append([M, r["method"], r["balance"], [round(u, 2) for u in r["stage_units"]],
                         f"{r['predicted_ms']:.0f}", f"{r['measured_ms']:.0f}",
                         f"{even['measured_ms'] / r['measured_ms']:.2f}x",
                         f"{r['predicted_ms'] / r['measured_ms']:.2f}", f"{r['bubble']:.1%}"])  # fmt: skip
        ideal = [f"{sum(units) / K:g} each", f"{even['ideal_ms']:.0f}", "-"]
        ideal += [f"{even['measured_ms'] / even['ideal_ms']:.2f}x", "-", f"{even['ideal_bubble']:.1%}"]
        rows.append([M, "**ideal** (total / K per stage)", "-", *ideal])
        best = min(group, key=lambda r: r["measured_ms"])
        over = 100 * (statistics.mean(r["measured_ms"] / r["predicted_ms"] for r in group) - 1)
        notes.append(
            f"- M={M}: fastest measured is **{best['method']}** {best['balance']}, "
            f"{even['measured_ms'] / best['measured_ms']:.2f}x the even split "
            f"(predicted {even['predicted_ms'] / best['predicted_ms']:.2f}x); the ideal would be "
            f"{even['ideal_ms'] / even['predicted_ms'] * 100:.0f}% of the even split's predicted time. "
            f"Measured steps take {over:.0f}% longer than simulated on average (tf_gpipe and TensorFlow "
            "overhead per action, on a loaded machine)."
        )
    headers = "M|partition|balance|stage time units|predicted ms|measured ms|speed-up vs even|"
    headers += "predicted / measured|bubble (predicted)"
    harness.print_table(headers, rows, "## Step time per partition")
    print("\n" + "\n".join(notes) + "\n\n## `balance.report` for the time-balanced partition\n")
    kwargs = dict(time_costs=costs["time"], devices=devices[:K], num_micro_batches=len(sample))
    print(balance.report(profile, partitions["time, minmax"], sample, **kwargs))
    harness.finish("balance", unit_ms=unit, model=MODEL, costs=costs, results=results)


if __name__ == "__main__":
    app.run(main)
