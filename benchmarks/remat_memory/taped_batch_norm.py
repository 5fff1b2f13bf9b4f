"""A taped stage's backward of a CNN with BatchNormalization: before and after 31f4049.

Before 31f4049 the pooled BatchNormalization moments left a taped stage
(``remat="never"``, and the last stage of ``"except_last"``) with their gradients
connected; its gradient is gated (``tf_gpipe.gated``) over the outputs only, so
TensorFlow ran a second backward of every layer below a BatchNormalization through the
moments. This script times plain MobileNet (v1, alpha 0.25, 32 x 32 x 3, 10 classes,
``weights=None``: 28 BatchNormalizations) as a ``PipelineModel`` on ``--stages`` logical
CPUs, and reads the allocator's peak (``TF_CPU_ALLOCATOR_USE_BFC=true``). Give ``--root``
a ``git archive`` of another commit to measure its ``tf_gpipe``; alternate the two runs:

    S=/tmp/snap_1f9bbf2; mkdir -p $S && git archive 1f9bbf2 | tar -x -C $S
    for i in 1 2 3; do for r in $S .; do
        python benchmarks/remat_memory/taped_batch_norm.py --root=$r; done; done

Results: benchmarks/remat_memory/README.md. Never run by the tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app, flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
HERE = os.path.dirname(os.path.abspath(__file__))

FLAGS = flags.FLAGS
flags.DEFINE_string("root", os.path.dirname(os.path.dirname(HERE)), "Checkout whose tf_gpipe is measured.")
flags.DEFINE_integer("stages", 2, "K.")
flags.DEFINE_integer("micro_batches", 4, "M.")
flags.DEFINE_integer("batch", 128, "Global batch.")
flags.DEFINE_list("remat", ["never", "except_last", "always"], "Remat modes to time.")
flags.DEFINE_integer("steps", 7, "Timed steps (median), after two untimed ones.")


def main(argv):
    del argv
    sys.path.insert(0, os.path.abspath(FLAGS.root))
    import tf_gpipe

    tf_gpipe.configure_virtual_cpus(FLAGS.stages)
    import keras
    import numpy as np
    import tensorflow as tf

    assert os.path.abspath(tf_gpipe.__file__).startswith(os.path.abspath(FLAGS.root)), tf_gpipe.__file__
    rng = np.random.RandomState(0)
    x = rng.rand(FLAGS.batch, 32, 32, 3).astype("float32")
    y = rng.randint(0, 10, FLAGS.batch)
    print(f"root {FLAGS.root}; K={FLAGS.stages} M={FLAGS.micro_batches} batch {FLAGS.batch}")
    print("| remat | median step ms | peak MiB |")
    print("|---|---|---|")
    for remat in FLAGS.remat:
        keras.utils.set_random_seed(0)
        net = keras.applications.MobileNet(
            input_shape=(32, 32, 3), alpha=0.25, weights=None, classes=10, include_top=True
        )
        pm = tf_gpipe.PipelineModel(
            net.layers[1:],
            num_stages=FLAGS.stages,
            num_micro_batches=FLAGS.micro_batches,
            devices=[f"/device:CPU:{i}" for i in range(FLAGS.stages)],
            remat=remat,
        )
        pm.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy())
        for _ in range(2):
            pm.train_on_batch(x, y)
        tf.config.experimental.reset_memory_stats("CPU:0")
        times = []
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            pm.train_on_batch(x, y)
            times.append(time.perf_counter() - t0)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
        print(f"| {remat} | {1e3 * statistics.median(times):.1f} | {peak:.1f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
