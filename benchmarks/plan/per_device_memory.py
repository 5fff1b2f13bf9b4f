"""The planner's per-device memory prediction against per-device allocators, on a CPU.

Logical CPUs share one allocator, so ``plan_validation.py`` can only compare the process's
peak with the prediction summed over devices; there, momentary buffers of several devices'
backwards that happen to run at once add up (benchmarks/plan/README.md, "Reading it"). Here each
stage runs in a worker process of its own (TensorFlow's cluster runtime, as
``tf_gpipe.cluster`` uses it), so each device has its own allocator, as a GPU would, and
its peak is read where it is: each worker answers ``reset``/``read`` on its stdin with
``tf.config.experimental.get_memory_info("CPU:0")`` of its own process.

The model is ``plan_validation.py``'s, with each ``Work`` layer replaced by ``Scale``: the
same tensors (``y = x * w``, ``dx = dy * w``, ``dw = sum(dy * x)``) without the host call
(a worker cannot run the client's Python). The profile is ``probe.py``'s (``--cache_dir``,
made first if missing, with ``Work`` on logical CPUs), the candidate as ``probe.py`` picks it.
Per device: the predicted peak (``candidate.peak_bytes``) and the worker allocator's peak
over ``--steps`` steps after two, above what the worker held before the model was made.

    TF_CPU_ALLOCATOR_USE_BFC=true python benchmarks/plan/per_device_memory.py --model=cnn \\
        --schedule=interleaved --micro_batches=4 --virtual_stages=2 --remat=always

Never run by the tests.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import plan_validation as pv  # noqa: E402  (after the path: defines the model flags)
from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
pv.define_candidate_flags()
flags.DEFINE_enum(
    "micro_batch_loops", "auto", ["auto", "true", "false"], "PipelineModel(micro_batch_loops=...)."
)
flags.DEFINE_string("cache_dir", "/tmp/tf_gpipe_plan_probe", "Where the profile is kept (probe.py's).")
flags.DEFINE_string("worker_cluster", "", "Internal: run as a worker of this cluster (JSON).")
flags.DEFINE_integer("worker_task", -1, "Internal: the worker's task index.")
flags.DEFINE_bool("profile_only", False, "Internal: profile the model into the cache and exit.")
MiB = 2**20
K = 4


def _cache() -> str:
    return os.path.join(FLAGS.cache_dir, f"{FLAGS.model}_{FLAGS.batch}_{FLAGS.max_micro_batches}.pkl")


def _profile() -> None:
    """Profile on K logical CPUs with ``Work`` (as probe.py does) and keep it in the cache."""
    import serial_device as sd

    sd.configure_threads(inter_op=64, intra_op=2)
    import tf_gpipe

    tf_gpipe.configure_virtual_cpus(K)
    import keras

    keras.utils.set_random_seed(0)
    layers = pv._layers(FLAGS.model, pv._work_layer())
    devices = [f"/device:CPU:{i}" for i in range(K)]
    p = tf_gpipe.plan(layers, None, devices, FLAGS.budget_mib * MiB, FLAGS.batch, optimizer="adam",
                      max_micro_batches=FLAGS.max_micro_batches, repeats=FLAGS.repeats)  # fmt: skip
    os.makedirs(FLAGS.cache_dir, exist_ok=True)
    with open(_cache(), "wb") as f:
        pickle.dump((p.profile, p.update), f)


def _worker() -> None:
    """A TensorFlow server for one stage; answers ``reset``/``read`` about its own allocator."""
    import tensorflow as tf

    from tf_gpipe.cluster.worker import serve

    server = serve(json.loads(FLAGS.worker_cluster), "worker", FLAGS.worker_task)
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "reset":
            tf.config.experimental.reset_memory_stats("CPU:0")
        print(json.dumps(tf.config.experimental.get_memory_info("CPU:0")), flush=True)
    del server  # referenced until stdin closes: the server lives as long as the client asks


def _scale_layer():
    """``Work`` without its host call: the same tensors, forward and backward."""
    import keras
    import tensorflow as tf

    class Scale(keras.layers.Layer):
        def __init__(self, fixed_ms: float = 0.0, per_example_ms: float = 0.0, **kwargs):
            super().__init__(**kwargs)

        def build(self, input_shape):
            self.w = self.add_weight(shape=(), initializer="ones", name="w")

        def call(self, x):
            @tf.custom_gradient
            def run(x, w):
                y = x * w

                def grad(dy):
                    return dy * w, tf.reduce_sum(dy * x)

                return y, grad

            return run(x, tf.identity(keras.ops.convert_to_tensor(self.w)))

        def compute_output_shape(self, input_shape):
            return input_shape

    return Scale


class _Workers:
    def __init__(self, n: int):
        from tf_gpipe.cluster.local import free_port

        self.cluster = {"worker": [f"127.0.0.1:{free_port()}" for _ in range(n)]}
        argv = [sys.executable, os.path.abspath(__file__), f"--worker_cluster={json.dumps(self.cluster)}"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), HERE]))
        env.pop("TF_CONFIG", None)
        self.procs = [
            subprocess.Popen(
                argv + [f"--worker_task={i}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(n)
        ]
        for p in self.procs:
            while (line := p.stdout.readline()) and line.strip() != "READY":
                pass

    def ask(self, command: str) -> list[dict]:
        for p in self.procs:
            p.stdin.write(command + "\n")
            p.stdin.flush()
        return [json.loads(p.stdout.readline()) for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            p.kill()


def _measure() -> None:

    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe
    from tf_gpipe import cluster

    with open(_cache(), "rb") as f:
        prof, update = pickle.load(f)
    workers = _Workers(K)
    try:
        cluster.connect(workers.cluster)
        devices = cluster.worker_devices(K)
        M, v = FLAGS.micro_batches, FLAGS.virtual_stages
        p, c, _, _, process = pv.candidate(
            prof, update, devices, FLAGS.schedule, M, v, FLAGS.remat, FLAGS.balance
        )
        keras.utils.set_random_seed(0)
        layers = pv._layers(FLAGS.model, _scale_layer())
        shape = tuple(layers[0].shape[1:])
        rng = np.random.default_rng(0)
        x = tf.constant(rng.standard_normal((FLAGS.batch,) + shape, dtype=np.float32))
        y = tf.constant(rng.integers(0, 10, FLAGS.batch), dtype=tf.int32)
        base = [r["current"] for r in workers.ask("reset")]
        loops = {"auto": "auto", "true": True, "false": False}[FLAGS.micro_batch_loops]
        model = tf_gpipe.PipelineModel(layers, plan=p, micro_batch_loops=loops)
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=False)  # fmt: skip
        for _ in range(2):
            model.train_on_batch(x, y)
        workers.ask("reset")
        t0 = time.perf_counter()
        for _ in range(FLAGS.steps):
            model.train_on_batch(x, y)
        wall = (time.perf_counter() - t0) / FLAGS.steps
        peaks = [r["peak"] - b for r, b in zip(workers.ask("read"), base)]
    finally:
        workers.close()
    steps = f"{FLAGS.steps} steps after 2, {wall * 1e3:.0f} ms a step"
    print(f"{FLAGS.model}: {c.label()} balance={c.balance}; {steps}")
    print("| device | predicted MiB | measured MiB (its worker's allocator) | measured / predicted |")
    print("|---|---|---|---|")
    for d, (want, got) in enumerate(zip(c.peak_bytes, peaks)):
        print(f"| {d} | {want / MiB:.2f} | {got / MiB:.2f} | {got / want:.3f} |")
    want, got = sum(c.peak_bytes), sum(peaks)
    print(f"| sum | {want / MiB:.2f} | {got / MiB:.2f} | {got / want:.3f} |")
    print(f"process_peak (the prediction plan_validation.py compares): {process / MiB:.2f} MiB")


def main(argv):
    del argv
    if FLAGS.worker_task >= 0:
        return _worker()
    if FLAGS.profile_only:
        return _profile()
    if not os.path.exists(_cache()):
        profile = [sys.executable, os.path.abspath(__file__), "--profile_only", *sys.argv[1:]]
        subprocess.run(profile, check=True)
    _measure()


if __name__ == "__main__":
    app.run(main)
