"""The client side of tests/test_cluster.py, run in its own process.

pytest's process already initialized TensorFlow with 4 logical CPUs (conftest.py), and
connecting it to a cluster would change its context for every later test; so each
scenario runs here, in a fresh interpreter, against worker processes that the test
started (tf_gpipe.cluster.LocalCluster) and described in TF_CONFIG. Each scenario
prints one ``SUMMARY_<scenario> {json}`` line that the test parses; several scenarios
run in one process, in order, because starting TensorFlow is most of a run's cost.

Scenarios:
  equivalence  K stages on the workers' devices vs the same layers and weights as a
               keras.Sequential in this process: outputs, gradients, fit.
  replicated   data x pipeline: 2 replicas of a 2-stage pipeline, one per worker,
               gradients all-reduced, vs keras.Sequential on the whole batch.
  train        fit with ResumableCheckpoint under WorkerWatch; can pause after an
               epoch until the test has broken a worker, and can also run an
               uninterrupted reference fit on the cluster to compare with.
"""

from __future__ import annotations

import time

T0 = time.monotonic()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tf_gpipe  # noqa: E402
from tf_gpipe import cluster, micro_batch_loop  # noqa: E402

EXIT_WORKER_FAILED = 3

# Training steps built as loops over micro-batches (tf_gpipe.micro_batch_loop, the default
# where every stage is on a CPU, a worker's included).
LOOP_BUILDS: list[int] = []
_run_loop = micro_batch_loop.run


def _counted_loop_run(*args, **kwargs):
    LOOP_BUILDS.append(1)
    return _run_loop(*args, **kwargs)


micro_batch_loop.run = _counted_loop_run


def make_layers(width: int, depth: int, dropout: bool, seed: int = 7) -> list:
    keras.utils.set_random_seed(seed)
    layers = []
    for i in range(depth):
        layers.append(keras.layers.Dense(width, activation="tanh"))
        if dropout and i == 0:
            layers.append(keras.layers.Dropout(0.25, seed=5))
    layers.append(keras.layers.Dense(3))
    return layers


def data(n: int = 96, d: int = 8, seed: int = 0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, d).astype("float32"), rng.randint(0, 3, n)


def loss_fn():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def task_of(device: str) -> int:
    return tf.DeviceSpec.from_string(device).task


def equivalence(args) -> dict:
    spec = cluster.cluster_spec()
    k = args.equivalence_stages
    x, y = data()
    seq = keras.Sequential(make_layers(16, k + 1, dropout=False))
    seq.build((None, x.shape[1]))
    pm = tf_gpipe.PipelineModel(
        make_layers(16, k + 1, dropout=False), devices=cluster.worker_devices(k), num_micro_batches=4
    )
    pm.build((None, x.shape[1]))
    pm.set_weights(seq.get_weights())

    out_pm, out_seq = pm(x, training=False).numpy(), seq(x, training=False).numpy()
    grads = []
    for model in (pm, seq):
        with tf.GradientTape() as tape:
            loss = loss_fn()(y, model(x, training=True))
        grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])

    placement = {}
    for cell in pm.cells:
        variables = [v for layer in cell.layers for v in layer.variables]
        placement[str(cell.index)] = sorted({v.value.device for v in variables})
    before = pm.get_weights()
    for model in (pm, seq):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss_fn())
    built = len(LOOP_BUILDS)
    context.enable_run_metadata()  # the partition graphs: which device runs each op of a step
    hist_pm = pm.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0).history["loss"]
    metadata = context.export_run_metadata()
    context.disable_run_metadata()
    loop_builds = len(LOOP_BUILDS) - built
    hist_seq = seq.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0).history["loss"]
    slots = {v.path: v.value.device for v in pm.optimizer.variables if "dense" in v.path}
    return {
        "cluster": spec.as_dict(),
        "devices": pm.devices,
        "available": [d.name for d in tf.config.list_logical_devices()],
        "client_device": cluster.client_device(),
        "server_cluster": {j.name: dict(j.tasks) for j in context.get_server_def().cluster.job},
        "placement": placement,
        "slot_devices": slots,
        "stage_tasks": [task_of(c.device) for c in pm.cells],
        "max_output_diff": float(np.max(np.abs(out_pm - out_seq))),
        "max_grad_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(*grads)),
        "loss_pm": hist_pm,
        "loss_seq": hist_seq,
        "max_weight_diff_after_fit": max(
            float(np.max(np.abs(a - b))) for a, b in zip(pm.get_weights(), seq.get_weights())
        ),
        "max_weight_change": max(float(np.max(np.abs(a - b))) for a, b in zip(pm.get_weights(), before)),
        "loop_builds": loop_builds,
        "op_devices": op_devices(metadata),
    }


def op_devices(metadata) -> dict:
    """``{op type or "adam:" op type: sorted devices}`` over a run's partition graphs."""
    found: dict = {}
    for function in metadata.function_graphs:
        for graph in function.partition_graphs:
            for node in graph.node:
                for key in (node.op, "adam:" + node.op) if "/adam/" in f"/{node.name}" else (node.op,):
                    found.setdefault(key, set()).add(node.device)
    return {key: sorted(devices) for key, devices in found.items()}


def replicated(args) -> dict:
    """R=2 replicas of a 2-stage pipeline, replica r on worker r's two CPUs (2x2), and R=4
    replicas of one stage, one per CPU of the two workers (4x1), each vs keras.Sequential
    on the whole batch in this process."""
    devices = cluster.worker_devices(4)  # task-major: [t0/CPU0, t1/CPU0, t0/CPU1, t1/CPU1]
    result = _replicated([devices[0::2], devices[1::2]])
    result["4x1"] = _replicated([[d] for d in devices])
    return result


def _replicated(groups) -> dict:
    x, y = data()

    def make():
        return make_layers(16, 2, dropout=False, seed=11)

    rp = cluster.ReplicatedPipeline(make, groups, input_shape=(None, x.shape[1]), num_micro_batches=2)
    seq = keras.Sequential(make())
    seq.build((None, x.shape[1]))
    seq.set_weights(rp.replicas[0].get_weights())
    for model in (rp, seq):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss_fn())
    built = len(LOOP_BUILDS)
    hist_rp = rp.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    loop_builds = len(LOOP_BUILDS) - built
    hist_seq = seq.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history["loss"]
    w = [r.get_weights() for r in rp.replicas]
    return {
        "groups": groups,
        "placement": [sorted({v.value.device for v in r.trainable_variables}) for r in rp.replicas],
        "max_replica_diff": max(float(np.max(np.abs(a - b))) for r in w[1:] for a, b in zip(w[0], r)),
        "max_diff_vs_sequential": max(float(np.max(np.abs(a - b))) for a, b in zip(w[0], seq.get_weights())),
        "loss_replicated": hist_rp,
        "loss_sequential": hist_seq,
        "loop_builds": loop_builds,
    }


class Pause(keras.callbacks.Callback):
    """After epoch ``after`` (count of finished epochs), or after training step ``after_step``
    of the run, wait for the test's go file."""

    def __init__(self, after: int, go_file: str, after_step: int = 0):
        super().__init__()
        self.after, self.go_file, self.after_step, self.steps = after, go_file, after_step, 0

    def _pause(self):
        print("PAUSED", flush=True)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.go_file) and time.monotonic() < deadline:
            time.sleep(0.05)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.after_step:
            self._pause()

    def on_epoch_end(self, epoch, logs=None):
        print(f"EPOCH_DONE {epoch + 1}", flush=True)
        if epoch + 1 == self.after:
            self._pause()


def fit_pipeline(args, directory: str, pause: bool) -> tuple:
    x, y = data()
    pm = tf_gpipe.PipelineModel(
        make_layers(16, 3, dropout=True), devices=cluster.worker_devices(args.stages), num_micro_batches=3
    )
    pm.build((None, x.shape[1]))  # ResumableCheckpoint restores before the first step
    pm.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss_fn())
    save_freq = args.save_freq if args.save_freq == "epoch" else int(args.save_freq)
    resume = cluster.ResumableCheckpoint(directory, save_freq=save_freq)
    callbacks = [resume] + ([Pause(args.pause_after, args.go_file, args.pause_after_step)] if pause else [])
    with cluster.watch_workers(probe_interval=0.5, probe_timeout=2.0, grace=args.grace) as watch:
        callbacks.append(watch)
        pm.fit(x, y, batch_size=24, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return pm, resume


def train(args) -> dict:
    try:
        pm, resume = fit_pipeline(args, args.ckpt, pause=args.pause_after > 0 or args.pause_after_step > 0)
    except cluster.WorkerFailedError as e:
        print(f"WORKER_FAILED {e}", flush=True)
        sys.exit(EXIT_WORKER_FAILED)
    summary = {
        "restored_epoch": resume.restored_epoch,
        "restored_batch": resume.restored_batch,
        "iterations": int(pm.optimizer.iterations.numpy()),
        "weights": [w.tolist() for w in pm.get_weights()],
        "placement": [sorted({v.value.device for v in c.trainable_variables}) for c in pm.cells],
    }
    if args.reference_ckpt:
        ref, _ = fit_pipeline(args, args.reference_ckpt, pause=False)
        summary["reference_weights"] = [w.tolist() for w in ref.get_weights()]
        summary["reference_iterations"] = int(ref.optimizer.iterations.numpy())
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", nargs="+", choices=["equivalence", "replicated", "train"])
    parser.add_argument("--stages", type=int, default=2, help="stages of the train scenario")
    parser.add_argument("--equivalence_stages", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--reference_ckpt", default="")
    parser.add_argument("--pause_after", type=int, default=0)
    parser.add_argument("--pause_after_step", type=int, default=0)
    parser.add_argument("--save_freq", default="epoch", help="ResumableCheckpoint(save_freq=...)")
    parser.add_argument("--go_file", default="")
    parser.add_argument("--grace", type=float, default=20.0, help="WorkerWatch grace before exit")
    parser.add_argument("--client_address", default=None, help="connect(address=...)")
    args = parser.parse_args()
    print(f"IMPORTED after {time.monotonic() - T0:.1f} s", flush=True)
    cluster.connect(address=args.client_address)  # TF_CONFIG, set by the test
    for scenario in args.scenarios:
        start = time.monotonic()
        summary = {"equivalence": equivalence, "replicated": replicated, "train": train}[scenario](args)
        summary["seconds"] = round(time.monotonic() - start, 1)
        print(f"SUMMARY_{scenario} " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
