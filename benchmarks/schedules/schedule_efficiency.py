"""Measured step time of each pipeline schedule against its simulated makespan.

Every stage is one ``SerialWork`` layer (benchmarks/serial_device.py), so an action costs a
known time and the measured ``train_on_batch`` time can be compared with
``tf_gpipe.schedules.get(...).simulate(f, b).makespan``. One child process per K
(thread pools and logical CPUs must be set before TensorFlow starts). Efficiency =
theoretical / measured. Method, commands and results: benchmarks/schedules/README.md
(zb-h1, whose backward is split into B and W, is measured with
``--schedules=gpipe,1f1b,zb-h1 --m_per_k=1,2,4 --record``). Writes
--out/schedule_efficiency.{json,png} and --image. Never run by the tests.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["2", "4", "8"], "Values of K (pipeline devices).")
flags.DEFINE_list("micro_batches", ["1", "2", "4", "8", "16", "32"], "Values of M.")
flags.DEFINE_list("m_per_k", [], "Values of M / K (e.g. 1,2,4: M in {K, 2K, 4K}); replaces --micro_batches.")
flags.DEFINE_list("schedules", ["gpipe", "1f1b", "interleaved"], "Schedules to run (also: zb-h1).")
flags.DEFINE_list("remats", ["never", "always"], "remat modes.")
flags.DEFINE_enum(
    "micro_batch_loops",
    "auto",
    ["auto", "true", "false"],
    "PipelineModel(micro_batch_loops=...) for GPipe with remat=always: 'auto' (the library's default: "
    "loops over micro-batches on CPUs), 'true' (the loops), 'false' (built out).",
)
flags.DEFINE_integer("virtual_stages", 2, "v for the interleaved schedule.")
flags.DEFINE_float("forward_ms", 10.0, "f: cost of one forward action of one (whole) stage.")
flags.DEFINE_float("backward_ms", 20.0, "b: cost of one backward action of one (whole) stage.")
flags.DEFINE_float(
    "weight_ms",
    10.0,
    "w: the weight-gradient share of backward_ms. With a split schedule (zb-h1) in --schedules every "
    "schedule runs SplitSerialWork: a backward is b-w ms of input gradient then w ms of weight gradient.",
)
flags.DEFINE_bool(
    "record",
    False,
    "After the timed steps, run one step with the host work logged (busy time per device) and one "
    "recorded with tf_gpipe.timeline (peak stashes per device); report measured bubble and stashes.",
)
flags.DEFINE_integer("warmup", 1, "Untimed calls after the first (tracing) one.")
flags.DEFINE_integer("steps", 3, "Timed train_on_batch calls per configuration (median reported).")
flags.DEFINE_bool(
    "py_function_demo",
    True,
    "Also time one config (K=4, M=8, gpipe) with SerialWork(mode='py_function'), whose stateful "
    "host op tf.function serializes across devices.",
)
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the PNG and JSON.")
flags.DEFINE_string(
    "image",
    os.path.join(harness.REPO_ROOT, "docs", "images", "schedule_efficiency.png"),
    "Also save the plot here (for benchmarks/schedules/README.md); empty: only --out.",
)
flags.DEFINE_string(
    "from_json",
    None,
    "Print the tables and redraw the plot (into --out) from a saved schedule_efficiency.json; run nothing.",
)
# child mode
flags.DEFINE_bool("child", False, "Internal: run every configuration of one K, print RESULT lines.")
flags.DEFINE_integer("k", 4, "Internal (child): K.")


def _costs(schedule, f: float, b: float, w: float, remat: str, split_layer: bool):
    """``simulate`` arguments: per-stage forward, full-backward and W costs of what the engine runs.

    A re-materialized backward replays the forward first; a split schedule replays it in
    B and again in W. With ``SplitSerialWork`` stage 0's input-gradient half never runs
    (its input needs no gradient: TensorFlow prunes it, whatever the schedule).
    """
    v, S = schedule.virtual_stages, schedule.num_virtual_stages
    replay = f / v if remat == "always" else 0.0
    if not split_layer:
        return f / v, replay + b / v, None
    if not schedule.split_backward:
        return f / v, [replay + w / v] + [replay + b / v] * (S - 1), None
    weight = replay + w
    backward = [weight] + [replay + (b - w) + weight] * (S - 1)
    return f, backward, [weight] * S


def _theory(schedule, f: float, b: float, remat: str, w: float = 0.0, split_layer: bool = False):
    """(makespan, bubble, n_crit, busy per device) of the simulated schedule with per-action costs."""
    fwd, bwd, wgt = _costs(schedule, f, b, w, remat, split_layer)
    timeline = schedule.simulate(fwd, bwd, weight_cost=wgt)
    eps = 1e-3
    bumped = [c + eps for c in bwd] if isinstance(bwd, list) else bwd + eps
    n_crit = (schedule.simulate(fwd + eps, bumped, weight_cost=wgt).makespan - timeline.makespan) / eps
    bubble = schedule.bubble_fraction(fwd, bwd, weight_cost=wgt) if timeline.makespan > 0 else float("nan")
    busy = [timeline.busy(d) for d in range(schedule.num_devices)]
    return timeline.makespan, bubble, round(n_crit), busy


def child() -> None:
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    from split_serial_work import SplitSerialWork

    import tf_gpipe

    K = FLAGS.k
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    f, b, v_inter = FLAGS.forward_ms, FLAGS.backward_ms, FLAGS.virtual_stages
    w = FLAGS.weight_ms
    split_layer = "zb-h1" in FLAGS.schedules
    Ms = [k * K for k in map(int, FLAGS.m_per_k)] if FLAGS.m_per_k else list(map(int, FLAGS.micro_batches))

    configs = []
    for remat in FLAGS.remats:
        for M in Ms:
            for name in FLAGS.schedules:
                if name == "interleaved" and M % K:
                    continue
                configs.append((M, name, remat, "stateless"))
    if FLAGS.py_function_demo and K == 4:
        configs.append((8, "gpipe", "never", "py_function"))

    for M, name, remat, mode in configs:
        v = v_inter if name == "interleaved" else 1
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        if split_layer:
            work = [
                SplitSerialWork(s % K, f / v, b / v, mode=mode, weight_ms=w / v, name=f"serial_s{s}")
                for s in range(K * v)
            ]
        else:
            work = [sd.SerialWork(s % K, f / v, b / v, mode=mode, name=f"serial_s{s}") for s in range(K * v)]
        layers = [keras.layers.InputLayer(shape=(4,))] + work
        model = tf_gpipe.PipelineModel(
            layers,
            num_stages=K,
            num_micro_batches=M,
            remat=remat,
            schedule=name,
            virtual_stages=v,
            micro_batch_loops={"auto": "auto", "true": name == "gpipe" and remat == "always", "false": False}[
                FLAGS.micro_batch_loops
            ],
        )
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((M, 4), dtype=np.float32))
        y = tf.constant(rng.standard_normal((M, 4), dtype=np.float32))
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        trace_s = time.perf_counter() - t0
        for _ in range(FLAGS.warmup):
            model.train_on_batch(x, y)
        times = []
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            model.train_on_batch(x, y)  # returns numpy logs: synchronizes
            times.append((time.perf_counter() - t0) * 1e3)
        plan = tf_gpipe.schedules.get(name, K, M, v)
        S = plan.num_virtual_stages
        theory, bubble, n_crit, busy = _theory(plan, f, b, remat, w, split_layer)
        measured = statistics.median(times)
        recorded = {}
        if FLAGS.record:
            sd.clear_work_log()
            sd.work_log(True)
            model.train_on_batch(x, y)
            sd.work_log(False)
            logged, calls = [0.0] * K, {"B": 0, "W": 0}
            for dev, kind, t0, t1 in sd.work_log():
                logged[dev] += (t1 - t0) * 1e3
                calls[kind] = calls.get(kind, 0) + 1
            with tf_gpipe.timeline.record(model) as rec:
                model.train_on_batch(x, y)
            live = tf_gpipe.timeline.live_stashes(rec.steps()[-1])
            recorded = dict(
                measured_bubble=1 - sum(busy) / (K * measured),
                work_ratio=sum(logged) / sum(busy) if sum(busy) else float("nan"),
                # Input- and weight-gradient host calls: a half that ran the other's work shows here.
                calls=[calls["B"], calls["W"]],
                expected_calls=[(S - 1) * M, S * M] if split_layer else [S * M, 0],
                stashes=[live.get(dev, 0) for dev in range(K)],
                peak_in_flight=plan.peak_in_flight(),
            )
        result = dict(
            K=K,
            M=M,
            schedule=name,
            v=v,
            remat=remat,
            mode=mode,
            measured_ms=measured,
            times_ms=times,
            theory_ms=theory,
            efficiency=theory / measured,
            bubble=bubble,
            n_crit=n_crit,
            trace_s=trace_s,
            f=f,
            b=b,
            w=w if split_layer else None,
            loadavg=harness.loadavg(),
            **recorded,
        )
        harness.emit(result)


def _rows(results, remat):
    rows = []
    for r in results:
        if r["remat"] != remat or r["mode"] != "stateless":
            continue
        over = r["measured_ms"] - r["theory_ms"]
        best = min(r["times_ms"])
        sched = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
        rows.append(
            [
                r["K"],
                r["M"],
                sched,
                f"{r['measured_ms']:.1f}",
                f"{r['theory_ms']:.1f}",
                f"**{r['efficiency']:.3f}**" if r["efficiency"] < 0.9 else f"{r['efficiency']:.3f}",
                f"{r['theory_ms'] / best:.3f}" if best > 0 else "n/a",
                f"{r['bubble']:.3f}",
                f"{over:.1f}",
                r["n_crit"],
                f"{over / r['n_crit']:.2f}",
            ]
        )
    return rows


HEADERS = [
    "K",
    "M",
    "schedule",
    "measured ms (median)",
    "theoretical ms",
    "efficiency",
    "efficiency (best step)",
    "bubble",
    "overhead ms",
    "n_crit",
    "overhead / crit. action ms",
]


STASH_HEADERS = [
    "K",
    "M",
    "remat",
    "schedule",
    "measured ms",
    "simulated ms",
    "efficiency",
    "measured bubble",
    "simulated bubble",
    "stashes per device (recorded)",
    "peak_in_flight (simulated)",
    "host work logged / simulated",
    "B, W host calls (expected)",
]


def _stash_rows(results):
    """Bubble and stashes, measured against the simulation, for runs with ``--record``."""
    rows = []
    order = {"gpipe": 0, "1f1b": 1, "zb-h1": 2}
    done = [r for r in results if "stashes" in r and r["mode"] == "stateless"]
    for r in sorted(done, key=lambda r: (r["K"], r["M"], r["remat"], order.get(r["schedule"], 9))):
        rows.append(
            [
                r["K"],
                r["M"],
                r["remat"],
                r["schedule"],
                f"{r['measured_ms']:.1f}",
                f"{r['theory_ms']:.1f}",
                f"{r['efficiency']:.3f}",
                f"{r['measured_bubble']:.1%}",
                f"{r['bubble']:.1%}",
                " ".join(map(str, r["stashes"])),
                " ".join(map(str, r["peak_in_flight"])),
                f"{r['work_ratio']:.2f}",
                f"{r['calls'][0]}, {r['calls'][1]} ({r['expected_calls'][0]}, {r['expected_calls'][1]})",
            ]
        )
    return rows


def report(results, f: float, b: float, remats) -> None:
    """The Markdown tables and the summary lines."""
    stash_rows = _stash_rows(results)
    if stash_rows:
        w = next((r["w"] for r in results if r.get("w") is not None), None)
        split = f" = {b - w:g} ms B + {w:g} ms W" if w is not None else ""
        print(
            f"\n## bubble and stashes (f = {f:g} ms, b = {b:g} ms{split}; measured bubble = "
            "1 - simulated busy time / (K x measured step))\n"
        )
        print(harness.md_table(STASH_HEADERS, stash_rows))
    for remat in remats:
        rows = _rows(results, remat)
        if not rows:
            continue
        bwd = f"f+b = {f + b:g}" if remat == "always" else f"b = {b:g}"
        print(f"\n## remat={remat} (forward f = {f:g} ms, backward {bwd} ms per stage)\n")
        print(harness.md_table(HEADERS, rows))
    ok = [r for r in results if r["mode"] == "stateless"]
    if ok and f + b > 0:
        worst = min(ok, key=lambda r: r["efficiency"])
        below = [r for r in ok if r["efficiency"] < 0.9]
        best_eff = [r["theory_ms"] / min(r["times_ms"]) for r in ok]
        print(
            f"\n- efficiency (median step): min {worst['efficiency']:.3f} (K={worst['K']} M={worst['M']} "
            f"{worst['schedule']} remat={worst['remat']}), median "
            f"{statistics.median(r['efficiency'] for r in ok):.3f}; {len(below)} of {len(ok)} "
            "configurations below 0.9"
        )
        print(
            f"- efficiency (best step): min {min(best_eff):.3f}, median {statistics.median(best_eff):.3f}; "
            f"{sum(e < 0.9 for e in best_eff)} of {len(ok)} configurations below 0.9"
        )
    for r in results:
        if r["mode"] != "py_function":
            continue
        serial = r["K"] * r["M"] * (f + b)
        print(
            f"- SerialWork(mode='py_function') K={r['K']} M={r['M']} {r['schedule']}: measured "
            f"{r['measured_ms']:.0f} ms vs theoretical {r['theory_ms']:.0f} ms and fully serial "
            f"K*M*(f+b) = {serial:.0f} ms: tf.function chains stateful host ops across devices"
        )


def parent() -> None:
    if FLAGS.from_json:
        with open(FLAGS.from_json) as fh:
            saved = json.load(fh)
        f, b, results = saved["forward_ms"], saved["backward_ms"], saved["results"]
        print(f"# from {FLAGS.from_json}: loadavg at start {saved['load_start']}, at end {saved['load_end']}")
        report(results, f, b, ["never", "always"])
        os.makedirs(FLAGS.out, exist_ok=True)
        _plot(
            [r for r in results if r["mode"] == "stateless"],
            os.path.join(FLAGS.out, "schedule_efficiency.png"),
            f,
            b,
        )
        return
    f, b = FLAGS.forward_ms, FLAGS.backward_ms
    load_start = harness.header(
        "tf_gpipe schedule efficiency benchmark (SerialWork devices)",
        __name__,
        skip=("child", "k", "from_json"),
        extra=["children: inter_op_parallelism_threads=64, intra_op_parallelism_threads=2"],
    )
    print(
        f"- per-action costs: forward f={f:g} ms, backward b={b:g} ms per stage (f/v, b/v per "
        f"virtual stage); remat=always backward = f+b\n",
        flush=True,
    )

    env = harness.child_env()
    results, loads = [], [load_start]
    t_all = time.perf_counter()
    passthrough = harness.flag_args(
        ("micro_batches", "m_per_k", "schedules", "remats", "virtual_stages", "forward_ms", "backward_ms")
        + ("weight_ms", "record", "warmup", "steps", "py_function_demo", "micro_batch_loops")
    )
    for K in map(int, FLAGS.stages):
        for r in harness.stream_child(__file__, ["--child", f"--k={K}", *passthrough], env):
            results.append(r)
            loads.append(r["loadavg"])
            print(
                f"K={r['K']} M={r['M']:2d} {r['schedule']:11s} remat={r['remat']:6s} {r['mode']:11s} "
                f"measured={r['measured_ms']:7.1f} ms theory={r['theory_ms']:7.1f} ms "
                f"eff={r['efficiency']:.3f} (trace {r['trace_s']:.1f} s; load {r['loadavg'].split()[0]})",
                flush=True,
            )

    report(results, f, b, FLAGS.remats)
    ok = [r for r in results if r["mode"] == "stateless"]
    load_end = harness.loadavg()
    print(f"- loadavg at end: {load_end}; total wall {time.perf_counter() - t_all:.0f} s")

    harness.save_json(
        os.path.join(FLAGS.out, "schedule_efficiency.json"),
        dict(env=harness.env_lines(), tf_gpipe=harness.tf_gpipe_line(), load_start=load_start,
             load_end=load_end, loads=loads, forward_ms=f, backward_ms=b, results=results),
    )  # fmt: skip
    _plot(ok, os.path.join(FLAGS.out, "schedule_efficiency.png"), f, b)


def _plot(results, path, f, b) -> None:
    plt = harness.pyplot()
    Ks = sorted({r["K"] for r in results})
    if not Ks:
        return
    fig, axes = plt.subplots(2, len(Ks), figsize=(5.2 * len(Ks), 8.2), squeeze=False)
    colors = {"gpipe": "tab:blue", "1f1b": "tab:orange", "interleaved": "tab:green", "zb-h1": "tab:red"}
    styles = {"never": "-", "always": "--"}
    for col, K in enumerate(Ks):
        ax_e, ax_t = axes[0][col], axes[1][col]
        for name, color in colors.items():
            for remat, style in styles.items():
                pts = sorted(
                    (r["M"], r["efficiency"], r["measured_ms"], r["theory_ms"])
                    for r in results
                    if r["K"] == K and r["schedule"] == name and r["remat"] == remat
                )
                if not pts:
                    continue
                Ms = [p[0] for p in pts]
                label = f"{name} remat={remat}"
                ax_e.plot(Ms, [p[1] for p in pts], style, marker="o", color=color, label=label)
                best = sorted(
                    (r["M"], r["theory_ms"] / min(r["times_ms"]))
                    for r in results
                    if r["K"] == K and r["schedule"] == name and r["remat"] == remat
                )
                ax_e.plot(
                    [p[0] for p in best],
                    [p[1] for p in best],
                    linestyle="none",
                    marker="_",
                    markersize=10,
                    color=color,
                    alpha=0.6,
                )
                ax_t.plot(Ms, [p[2] for p in pts], style, marker="o", color=color, label=f"{label} measured")
                ax_t.plot(Ms, [p[3] for p in pts], style, marker="x", color=color, alpha=0.4, lw=0.8)
        ax_e.axhline(0.9, color="gray", lw=0.8, ls=":")
        ax_e.set_ylim(0.5, 1.05)
        ax_e.set_title(f"K = {K}")
        ax_e.set_ylabel("efficiency = theoretical / measured\n(o median step, - best step)")
        ax_t.set_ylabel("step time, ms (o measured, x theoretical)")
        for ax in (ax_e, ax_t):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (micro-batches)")
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"tf_gpipe schedules on SerialWork devices (f={f:g} ms, b={b:g} ms per stage action): "
        "measured vs simulated"
    )
    fig.tight_layout()
    harness.save_figure(fig, path, FLAGS.image)


def main(argv):
    del argv
    if FLAGS.child:
        child()
    else:
        parent()


if __name__ == "__main__":
    app.run(main)
