"""What GPipe's loop over clock ticks costs per tick, against the step built out.

Every stage is one ``SerialWork`` layer (benchmarks/serial_device.py) with near-free
actions (``--forward_ms``, twice that backward), so a step's time is the machinery's:
the stage-function calls, and for the loop its loops, conds and TensorArrays. One process
builds both models (``tick_loop=True`` and built out, GPipe, ``remat="always"``) for each
``(K, M)`` and alternates their steps, ``--rounds`` times; the table gives the medians of
wall and process CPU time per step and per clock tick (``2 (M + K - 1)`` ticks a step).

    python benchmarks/compiled_stages/tick_overhead.py --stages=4,8 --micro_batches=32

Results: benchmarks/compiled_stages/README.md, "eighth session". Never run by the tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list("stages", ["8"], "Values of K.")
flags.DEFINE_list("micro_batches", ["32"], "Values of M.")
flags.DEFINE_float("forward_ms", 0.05, "Cost of one stage's forward action; backward: twice that.")
flags.DEFINE_integer("rounds", 7, "Alternated steps of each model, after two untimed ones.")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")
flags.DEFINE_bool("child", False, "Internal: measure one (K, M) in this process.")


def child() -> None:
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # before TensorFlow initializes
    import tf_gpipe

    K, M, f = int(FLAGS.stages[0]), int(FLAGS.micro_batches[0]), FLAGS.forward_ms
    tf_gpipe.configure_virtual_cpus(K)
    import keras
    import numpy as np
    import tensorflow as tf

    models = {}
    for name in ("built out", "loop"):
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        work = [sd.SerialWork(s, f, 2 * f, name=f"serial_s{s}") for s in range(K)]
        model = tf_gpipe.PipelineModel(
            [keras.layers.InputLayer(shape=(4,)), *work],
            num_stages=K,
            num_micro_batches=M,
            remat="always",
            tick_loop=name == "loop",
        )
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
        x = tf.constant(np.ones((M, 4), np.float32))
        for _ in range(2):
            model.train_on_batch(x, x)
        models[name] = (model, x)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in models}
    for _ in range(FLAGS.rounds):
        for name, (model, x) in models.items():
            cpu, wall = time.process_time(), time.perf_counter()
            model.train_on_batch(x, x)
            times[name][0].append((time.perf_counter() - wall) * 1e3)
            times[name][1].append((time.process_time() - cpu) * 1e3)
    for name, (wall_ms, cpu_ms) in times.items():
        harness.emit(
            dict(K=K, M=M, model=name, wall_ms=statistics.median(wall_ms), cpu_ms=statistics.median(cpu_ms))
        )


def main(argv) -> None:
    del argv
    if FLAGS.child:
        return child()
    harness.header("GPipe's loop over clock ticks against the built-out step, near-free stages")
    results, rows = [], []
    for K in map(int, FLAGS.stages):
        for M in map(int, FLAGS.micro_batches):
            found = harness.child(stages=[K], micro_batches=[M])
            results += found
            by = {r["model"]: r for r in found}
            if len(by) < 2:
                continue
            ticks = 2 * (M + K - 1)
            for name, r in by.items():
                ratio = r["wall_ms"] / by["built out"]["wall_ms"]
                rows.append(
                    [K, M, name, f"{r['wall_ms']:.1f}", f"{r['cpu_ms']:.1f}", f"{r['wall_ms'] / ticks:.2f}",
                     f"{r['cpu_ms'] / ticks:.2f}", f"{ratio:.2f}"]
                )  # fmt: skip
    harness.print_table(
        ["K", "M", "model", "wall ms", "CPU ms", "wall ms / tick", "CPU ms / tick", "wall / built out"], rows
    )
    harness.finish("tick_overhead", results=results)


if __name__ == "__main__":
    app.run(main)
