"""Step time of a deliberately imbalanced pipeline: even split vs each tf_gpipe.balance method.

The model is 12 layers on K=4 modelled devices: an "embedding" (1 time unit,
12 parameter units), ten "blocks" (1 time unit, 1 parameter unit each) and a
"head" (5 time units, 3 parameter units). Every layer is a ``CostLayer``: a
``SerialWork`` (benchmarks/serial_device.py) whose forward holds its stage's
device lock and sleeps ``units * unit_ms`` and whose backward sleeps twice
that, plus ``1000 * param_units`` weights that cost no time. So time and
parameters disagree exactly where real models do (an embedding table is big
and cheap; an output head is big and slow), the true per-stage costs are
known, and the step time of each partition can be compared with what
``tf_gpipe.schedules`` predicts for it and with the ideal, every stage costing
total / K.

Partitions compared: the even split by layer count (PipelineModel's default),
``balance_by("params" | "memory" | "time")`` with the optimal ``minmax``
solver, and ``balance_by("time", solver="min_variance")`` (torchgpipe's
heuristic). Costs are estimated on profiling copies of the layers (each with
its own lock), then each partition is trained with fresh layers whose lock is
their stage's device. remat="never" by default: a backward costs b = 2f.

Run (about 6 minutes on 2 busy cores):

    python3 benchmarks/balance/balance_benchmark.py

Prints a Markdown table; writes benchmarks/out/balance.{json,png} and
benchmarks/balance/README.md (--md). Never run by the tests.
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
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string("md", os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md"), "Report.")

# (name, time units, parameter units)
MODEL = [("embedding", 1, 12)] + [(f"block_{i}", 1, 1) for i in range(10)] + [("head", 5, 3)]
WIDTH = 16  # features of the (identity) activations


def make_layer_class(sd, keras, tf):
    @keras.saving.register_keras_serializable(package="tf_gpipe_benchmarks")
    class CostLayer(sd.SerialWork):
        """SerialWork of ``time_units`` (f = units * unit_ms, b = 2f) with ``1000 * param_units`` weights."""

        def __init__(self, device_index, time_units, param_units, unit_ms, **kwargs):
            f = time_units * unit_ms
            super().__init__(device_index, f, 2 * f, **kwargs)
            self.param_units = param_units

        def build(self, input_shape):
            super().build(input_shape)
            self.table = self.add_weight(shape=(1000 * self.param_units,), initializer="zeros", name="table")

        def call(self, x):
            # The weights join the output (times 0) so they get a gradient like any weight.
            return super().call(x) + 0.0 * tf.reduce_sum(self.table)

    return CostLayer


def main(argv):
    del argv
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K = FLAGS.stages
    devices = tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_gpipe import balance, schedules
    from tf_gpipe.partition import even_balance

    CostLayer = make_layer_class(sd, keras, tf)
    unit = FLAGS.unit_ms
    units = [t for _, t, _ in MODEL]
    load_start, wall_start = harness.loadavg(), time.perf_counter()

    def layers_for(bal, lock_of=None):
        stage_of = [s for s, n in enumerate(bal) for _ in range(n)]
        return [
            CostLayer(stage_of[i] if lock_of is None else lock_of(i), t, p, unit, name=name)
            for i, (name, t, p) in enumerate(MODEL)
        ]

    # ------------------------------------------------------------------ estimate and solve
    profile = layers_for([len(MODEL)], lock_of=lambda i: 100 + i)  # own lock each: no waiting
    M0 = int(FLAGS.micro_batches[0])
    sample = np.zeros((M0, WIDTH), "float32")
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

    # ------------------------------------------------------------------ measure
    total = sum(units)
    b_factor = 3 if FLAGS.remat == "always" else 2  # a re-materialized backward replays the forward

    def predicted(stage_units, M):
        plan = schedules.get("gpipe", K, M)
        fwd = [u * unit for u in stage_units]
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
        ideal_ms, ideal_bubble = predicted([total / K] * K, M)
        for method, bal in partitions.items():
            model = tf_gpipe.PipelineModel(
                [keras.Input((WIDTH,))] + layers_for(bal),
                balance=bal,
                devices=devices[:K],
                num_micro_batches=M,
                remat=FLAGS.remat,
            )
            model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
            for _ in range(1 + FLAGS.warmup):  # the first call traces
                model.train_on_batch(x, y)
            stage_units = balance.stage_costs(units, bal)
            pred_ms, bubble = predicted(stage_units, M)
            results.append(dict(M=M, method=method, balance=bal, stage_units=stage_units, bubble=bubble,
                                predicted_ms=pred_ms, ideal_ms=ideal_ms, ideal_bubble=ideal_bubble,
                                times_ms=[], loads=[]))  # fmt: skip
            runs.append((model, x, y))
    for _ in range(FLAGS.steps):
        for r, (model, x, y) in zip(results, runs):
            t0 = time.perf_counter()
            model.train_on_batch(x, y)  # returns numpy logs: synchronizes
            r["times_ms"].append((time.perf_counter() - t0) * 1e3)
            r["loads"].append(harness.loadavg())
    for r in results:
        r["measured_ms"] = statistics.median(r["times_ms"])
        print(f"M={r['M']:2d} {r['method']:32s} balance={r['balance']} units={r['stage_units']} "
              f"measured={r['measured_ms']:.0f} ms (all {[round(t) for t in r['times_ms']]}) "
              f"predicted={r['predicted_ms']:.0f} ms ideal={r['ideal_ms']:.0f} ms", flush=True)  # fmt: skip

    # ------------------------------------------------------------------ report
    load_end = harness.loadavg()
    table = markdown_table(results)
    profile_rows = [
        [name, t, f"{3 * t * unit:.1f}", f"{s * 1e3:.1f}", f"{p:,.0f}", f"{m / 1024:.1f}"]
        for (name, t, _), s, p, m in zip(MODEL, costs["time"], costs["params"], costs["memory"])
    ]
    profile_table = harness.md_table(
        ["layer", "time units", "true f+b ms", "by_time ms", "by_params", "by_memory KiB"], profile_rows
    )
    rep = balance.report(
        profile,
        partitions["time, minmax"],
        sample,
        time_costs=costs["time"],
        devices=devices[:K],
        num_micro_batches=M0,
    )
    print("\n" + table + "\n\n" + rep)
    saved = dict(env=harness.env_lines(), load_start=load_start, load_end=load_end, unit_ms=unit, model=MODEL)
    harness.save_json(os.path.join(FLAGS.out, "balance.json"), dict(saved, costs=costs, results=results))
    png = os.path.join(FLAGS.out, "balance.png")
    plot(results, png)
    wall_s = time.perf_counter() - wall_start
    write_md(table, profile_table, rep, load_start, load_end, profile_s, observations(results, K), wall_s)
    print(f"\n- wrote {png}, {os.path.join(FLAGS.out, 'balance.json')} and {FLAGS.md}")


def markdown_table(results) -> str:
    even = {r["M"]: r["measured_ms"] for r in results if r["method"].startswith("even")}
    rows = []
    for M in sorted({r["M"] for r in results}):
        group = [r for r in results if r["M"] == M]
        for r in group:
            rows.append([
                M, r["method"], str(r["balance"]), str([round(u, 2) for u in r["stage_units"]]),
                f"{r['predicted_ms']:.0f}", f"{r['measured_ms']:.0f}", f"{even[M] / r['measured_ms']:.2f}x",
                f"{r['predicted_ms'] / r['measured_ms']:.2f}", f"{r['bubble']:.1%}",
            ])  # fmt: skip
        r = group[0]
        each = sum(r["stage_units"]) / len(r["stage_units"])
        rows.append([M, "**ideal** (total / K per stage)", "-", f"{each:g} each", f"{r['ideal_ms']:.0f}", "-",
                     f"{even[M] / r['ideal_ms']:.2f}x", "-", f"{r['ideal_bubble']:.1%}"])  # fmt: skip
    headers = ["M", "partition", "balance", "stage time units", "predicted ms", "measured ms",
               "speed-up vs even", "predicted / measured", "bubble (predicted)"]  # fmt: skip
    return harness.md_table(headers, rows)


def plot(results, path) -> None:
    plt = harness.pyplot()
    Ms = sorted({r["M"] for r in results})
    fig, axes = plt.subplots(1, len(Ms), figsize=(6.5 * len(Ms), 4.6), squeeze=False)
    for ax, M in zip(axes[0], Ms):
        group = [r for r in results if r["M"] == M]
        names = [r["method"].replace(", ", "\n") for r in group]
        xs = range(len(group))
        ax.bar([x - 0.2 for x in xs], [r["measured_ms"] for r in group], 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [r["predicted_ms"] for r in group], 0.4, label="predicted (simulated)")
        ax.axhline(group[0]["ideal_ms"], color="k", ls="--", lw=1, label="ideal (total / K per stage)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel("train step, ms")
        ax.set_title(f"K = {len(group[0]['balance'])}, M = {M}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="lower left", framealpha=0.95)
    fig.suptitle("tf_gpipe.balance on SerialWork devices: embedding + 10 blocks + heavy head")
    fig.tight_layout()
    harness.save_figure(fig, path)


def observations(results, K) -> str:
    """What the table says, in numbers from this run."""
    lines = []
    for M in sorted({r["M"] for r in results}):
        group = {r["method"]: r for r in results if r["M"] == M}
        even, best = group["even split (layer count)"], min(group.values(), key=lambda r: r["measured_ms"])
        over = 100 * (statistics.mean(r["measured_ms"] / r["predicted_ms"] for r in group.values()) - 1)
        lines.append(
            f"- M={M}: fastest measured is **{best['method']}** {best['balance']}, "
            f"{even['measured_ms'] / best['measured_ms']:.2f}x the even split "
            f"(predicted {even['predicted_ms'] / best['predicted_ms']:.2f}x); the ideal would be "
            f"{even['ideal_ms'] / even['predicted_ms'] * 100:.0f}% of the even split's predicted time. "
            f"Measured steps take {over:.0f}% longer than simulated on average (tf_gpipe and TensorFlow "
            "overhead per action, on a loaded machine)."
        )  # fmt: skip
    return "\n".join(lines)


def write_md(table, profile_table, rep, load_start, load_end, profile_s, observed, wall_s) -> None:
    flags_used = " ".join(
        f"--{name}={','.join(v) if isinstance(v, list) else v}"
        for name in ("stages", "micro_batches", "unit_ms", "remat", "profile_repeats", "warmup", "steps")
        for v in [FLAGS[name].value]
    )
    env = "\n".join(f"- {line}" for line in harness.env_lines())
    text = f"""# Balancing benchmark (`tf_gpipe.balance`)

{__doc__.split("Run (")[0].strip()}

## Command

```
python3 benchmarks/balance/balance_benchmark.py {flags_used}
```

## Environment

{env}
- {harness.tf_gpipe_line()}
- inter_op=64 so that K sleeping devices never starve TensorFlow's thread pool; total wall {wall_s:.0f} s
- `cat /proc/loadavg` at start: `{load_start}`; at end: `{load_end}` (other jobs share the 2 cores:
  sleeps are immune, tf_gpipe's per-action overhead is not)

## Per-layer estimates (profiled once, {profile_s:.1f} s)

{profile_table}

## Step time per partition

{table}

"predicted" is `tf_gpipe.schedules.get("gpipe", K, M).simulate(...)` with each stage's true
forward/backward time; "ideal" is the same schedule with every stage costing total / K (the
best any partition could do if layers were divisible). Plot: `benchmarks/out/balance.png`.

{observed}

Reading it:

- The step time follows the slowest stage (GPipe's clock ticks at its pace), so only a
  partition that lowers the largest stage helps. Here the head alone is 5 time units, above
  the ideal 16 / 4 = 4, so 5 is the best any contiguous partition can do: `time, minmax` finds
  it whenever the profile is right. The gap to "ideal" is the price of indivisible layers.
- `params` and `memory` see the embedding (12 of 25 parameter units, 1 of 16 time units) as
  the heavy layer: they give it a stage of its own and leave the head with two blocks, so
  the slowest stage stays at 7 units, as in the even split. Parameter counts are a fair proxy
  for time only in models whose big layers are also the slow ones.
- `min_variance` (torchgpipe's block-partition heuristic) rescales the costs to [0, 1] and
  stops as soon as the dearest stage exceeds the cheapest by at most 1, i.e. by up to the
  spread between the largest and the smallest layer (here 4 time units): with one heavy head
  that tolerance lets imbalanced splits stand (with exact costs, the even split itself: see
  tests/test_balance.py). `solve_minmax` is exact.
- `by_time` profiles each layer's forward + backward (here 3 x the forward sleep, plus
  TensorFlow's per-call overhead, 2 ms on a quiet machine and several times that under load,
  as the profile table shows). Only the ratios matter to the solver, and the layers are timed
  in turns, so a burst of load raises them all rather than one.

## `balance.report` for the time-balanced partition

```
{rep}
```
"""
    with open(FLAGS.md, "w") as fh:
        fh.write(text)


if __name__ == "__main__":
    app.run(main)
