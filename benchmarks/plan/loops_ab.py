"""One schedule with the loops over micro-batches against built out, on plan_validation's MLP
and its serial ``Work`` layers, K=4, ``--remat`` (default "never"), the planner's cut for M.

    python benchmarks/plan/loops_ab.py --schedule=zb-h1 --micro_batches=2

Prints each build's median step time (rounds of steps, the two alternated) beside the
planner's prediction. Never run by the tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import plan_validation as pv
from absl import app, flags

flags.DEFINE_string("schedule", "zb-h1", "Schedule to build both ways.")
flags.DEFINE_integer("micro_batches", 2, "M.")
flags.DEFINE_integer("rounds", 5, "Rounds, each build timed once a round.")
flags.DEFINE_string("remat", "never", "Remat mode.")
FLAGS = flags.FLAGS


def main(_) -> None:
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)  # as plan_validation's children
    import tf_gpipe

    devices = tf_gpipe.configure_virtual_cpus(4)
    import keras
    import numpy as np

    Work = pv._work_layer()
    layers = pv._layers("mlp", Work)
    M = FLAGS.micro_batches
    p = tf_gpipe.plan(
        layers, None, devices, 2**30, FLAGS.batch, optimizer="adam", max_micro_batches=M,
        schedules=[FLAGS.schedule], remats=[FLAGS.remat], repeats=2,
    )  # fmt: skip
    p.chosen = next(c for c in p.candidates if c.num_micro_batches == M and c.num_stages == 4)
    print(p)
    x, y = pv.batch(np.random.default_rng(0), pv.input_shape(layers))
    models = {}
    for loops in (True, False):
        keras.utils.set_random_seed(0)
        model = tf_gpipe.PipelineModel(pv._layers("mlp", Work), plan=p, micro_batch_loops=loops)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer="adam", loss=loss, jit_compile=False)
        for _ in range(2):
            model.train_on_batch(x, y)
        models[loops] = model
    times: dict = {k: [] for k in models}
    for _ in range(FLAGS.rounds):
        for k, model in models.items():
            t = time.perf_counter()
            for _ in range(3):
                model.train_on_batch(x, y)
            times[k].append((time.perf_counter() - t) / 3 * 1e3)
    for k, v in times.items():
        name = "loops" if k is True else "built out"
        print(f"{name}: median {statistics.median(v):.1f} ms", [round(t) for t in v])
    print(f"predicted {p.predicted_step_s * 1e3:.1f} ms")


if __name__ == "__main__":
    app.run(main)
