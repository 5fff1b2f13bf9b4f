"""Bytes on the wire per training step, per worker process, on loopback workers.

Two scenarios, each in one client process against ``LocalCluster`` workers with one CPU each:

* ``R=4 x K=1``: ``cluster.ReplicatedPipeline`` with replica r on worker r. The target is a
  ring all-reduce's share: no worker sends or receives more than ``2 (R-1) / R x P``
  (P: the bytes of one replica's parameters) + 10%. Measured twice: the averaging alone
  (``_StageAllReduce.mean`` on gradients made on the workers, the means kept there) and
  whole ``train_on_batch`` steps (SGD), which add the input shard, the logits, the loss
  gradient and wherever the optimizer's update runs.
* ``K=2, Adam, one replica``: a 2-stage pipeline, stage k on worker k (``PipelineModel``
  and ``ReplicatedPipeline`` with one device group). Target: all the bytes of all the
  processes within 1.2x of what the step must move: the input, the labels, the
  boundary activations and their gradients, the logits and their gradient. Then a small
  language model (an embedding, a Dense, a V x W output head; tokens of length 8) with the
  head tied to the embedding (the matrix on worker 1, read by worker 0) and untied.

How the bytes are counted: the kernel's TCP counters of every socket of the client and the
workers (``ss -tinp``: ``bytes_sent`` / ``bytes_received`` of each connection, with its
process id), read after warm-up steps and again after ``--steps`` more steps; the
difference over the steps, per process. Everything gRPC puts on the wire counts (framing,
RPC headers, the client's step dispatch, the workers' status polls): what the runtime
really moves, not a model of it. Method, command and results: benchmarks/cluster/README.md.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness  # also puts the repo root on sys.path
from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("replicas", 4, "R of the all-reduce scenario (one worker each).")
flags.DEFINE_integer("width", 512, "Dense width W: P = 2 W^2 + 10 W + ... floats.")
flags.DEFINE_integer("batch", 64, "Global mini-batch.")
flags.DEFINE_integer("micro_batches", 4, "M.")
flags.DEFINE_integer("steps", 5, "Counted steps per scenario (after 2 warm-up steps).")
flags.DEFINE_string("out", harness.OUT_DIR, "Directory for the JSON.")
flags.DEFINE_string("from_json", "", "Only reprint the tables from the JSON of an earlier run.")
flags.DEFINE_bool("child", False, "Internal: the client process.")
flags.DEFINE_list("worker_pids", [], "Internal (child): the workers' process ids, by task.")

_SOCKET = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+users:\(\(.*?pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_sent|bytes_received):(\d+)")


def sockets() -> dict[tuple[str, str], tuple[int, int, int]]:
    """``{(local, peer): (pid, bytes sent, bytes received)}`` of every established TCP socket."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True)
    found, key = {}, None
    for line in out.stdout.splitlines():
        # ss -H without a state column when one state is asked for: "Recv-Q Send-Q local peer users".
        m = _SOCKET.match("ESTAB " + line) if not line.startswith((" ", "\t")) else None
        if m:
            key, pid = (m.group(1), m.group(2)), int(m.group(3))
            found[key] = (pid, 0, 0)
        elif key is not None and key in found:
            counters = dict((k, int(v)) for k, v in _COUNTER.findall(line))
            if counters:
                pid = found[key][0]
                found[key] = (pid, counters.get("bytes_sent", 0), counters.get("bytes_received", 0))
    return found


def traffic(before: dict, after: dict, pids: dict[int, str], steps: int) -> dict[str, dict[str, float]]:
    """Bytes per step that each named process sent and received, and per link (a -> b)."""
    port_owner = {local: after[(local, peer)][0] for (local, peer) in after}
    per: dict[str, dict[str, float]] = {name: {"sent": 0.0, "received": 0.0} for name in pids.values()}
    links: dict[str, float] = {}
    for key, (pid, sent, received) in after.items():
        if pid not in pids:
            continue
        _, sent0, received0 = before.get(key, (pid, 0, 0))
        name = pids[pid]
        per[name]["sent"] += (sent - sent0) / steps
        per[name]["received"] += (received - received0) / steps
        peer = pids.get(port_owner.get(key[1], -1), "other")
        link = f"{name} -> {peer}"
        links[link] = links.get(link, 0.0) + (sent - sent0) / steps
    return {"processes": per, "links": links}


def child() -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_gpipe
    from tf_gpipe import cluster

    cluster.connect()  # TF_CONFIG from the parent
    pids = {int(p): f"worker {t}" for t, p in enumerate(FLAGS.worker_pids)}
    pids[os.getpid()] = "client"
    R, W, N = FLAGS.replicas, FLAGS.width, FLAGS.batch
    devices = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(R)]
    rng = np.random.RandomState(0)
    x = tf.constant(rng.randn(N, W).astype("float32"))
    y = tf.constant(rng.randint(0, 10, N).astype("int32"))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make():
        keras.utils.set_random_seed(0)
        return [
            keras.layers.Dense(W, activation="relu"),
            keras.layers.Dense(W, activation="relu"),
            keras.layers.Dense(10),
        ]

    def measure(run, name, **info):
        for _ in range(2):  # traces, first connections
            run()
        before = sockets()
        for _ in range(FLAGS.steps):
            run()
        result = traffic(before, sockets(), pids, FLAGS.steps)
        harness.emit(dict(scenario=name, **info, **result))

    # R x K=1: the averaging alone, then whole steps.
    rp = cluster.ReplicatedPipeline(
        make, [[d] for d in devices], input_shape=(None, W), num_micro_batches=FLAGS.micro_batches
    )
    rp.compile(optimizer=keras.optimizers.SGD(1e-3), loss=loss)
    variables = [r.trainable_variables for r in rp.replicas]
    P = 4 * sum(int(np.prod(v.shape)) for v in variables[0])

    @tf.function
    def average(fills):
        grads = [None] * R
        for r, replica in enumerate(variables):
            with tf.device(devices[r]):
                grads[r] = [tf.fill(v.shape, fills[r]) for v in replica]
        for replica, means in zip(variables, rp._all_reduce.mean(grads)):
            for v, mean in zip(replica, means):
                with tf.device(v.value.device):
                    v.assign(mean)

    fills = tf.constant(np.arange(1, R + 1, dtype="float32"))
    shard = 4 * (N // R) * W
    measure(lambda: average(fills), f"R={R} x K=1: all-reduce alone", R=R, P=P, shard=0)
    measure(lambda: rp.train_on_batch(x, y), f"R={R} x K=1: train_on_batch (SGD)", R=R, P=P, shard=shard)

    # K=2, Adam, one replica: stage k on worker k.
    boundary = 4 * N * W  # the activation between the stages, and its gradient
    needed = 4 * N * W + 4 * N + 2 * boundary + 2 * 4 * N * 10  # input, labels, boundary, logits
    pm = tf_gpipe.PipelineModel(
        make(), devices=devices[:2], balance=[1, 2], num_micro_batches=FLAGS.micro_batches
    )
    pm.build((None, W))
    pm.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    P2 = 4 * sum(int(np.prod(v.shape)) for v in pm.trainable_variables)
    measure(lambda: pm.train_on_batch(x, y), "K=2, Adam: PipelineModel", P=P2, needed=needed)
    one = cluster.ReplicatedPipeline(
        make, [devices[:2]], input_shape=(None, W), balance=[1, 2], num_micro_batches=FLAGS.micro_batches
    )
    one.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    measure(lambda: one.train_on_batch(x, y), "K=2, Adam: ReplicatedPipeline, R=1", P=P2, needed=needed)

    # The same with an L2 penalty on every kernel (Keras computes it where model.losses is
    # read), and evaluate: what the step must move does not change.
    def regularized():
        layers = make()
        for layer in layers:
            layer.kernel_regularizer = keras.regularizers.L2(1e-4)
        return layers

    reg = tf_gpipe.PipelineModel(
        regularized(), devices=devices[:2], balance=[1, 2], num_micro_batches=FLAGS.micro_batches
    )
    reg.build((None, W))
    reg.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["sparse_categorical_accuracy"])
    measure(lambda: reg.train_on_batch(x, y), "K=2, Adam, L2 kernels: PipelineModel", P=P2, needed=needed)
    forward = 4 * N * W + 4 * N + boundary  # input, labels, the boundary activation
    measure(lambda: reg.test_on_batch(x, y), "K=2, L2 kernels: evaluate", P=P2, needed=forward)

    # A token embedding tied to the output head (as GPT-2's), the two on different workers,
    # against the same layers untied: what sharing one V x W matrix across workers costs.
    V, T = W, 8
    tokens = tf.constant(rng.randint(0, V, (N, T)).astype("int32"))
    targets = tf.constant(rng.randint(0, V, (N, T)).astype("int32"))

    def lm(tie):
        keras.utils.set_random_seed(0)
        embedding = keras.layers.Embedding(V, W)
        head = harness.tied_head(embedding) if tie else keras.layers.Dense(V, use_bias=False)
        return [embedding, keras.layers.Dense(W, activation="relu"), head]

    lm_needed = 2 * 4 * N * T + 2 * 4 * N * T * W  # tokens, targets, the boundary and its gradient
    for tie in (False, True):
        with warnings.catch_warnings():  # the tied one's, naming the copies measured here
            warnings.simplefilter("ignore")
            model = tf_gpipe.PipelineModel(
                lm(tie), devices=devices[:2], balance=[1, 2], num_micro_batches=FLAGS.micro_batches
            )
        model.build((None, T))
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        name = f"K=2, Adam: embedding {'tied to' if tie else 'and'} head, V=W"
        measure(lambda m=model: m.train_on_batch(tokens, targets), name, P=4 * V * W, needed=lm_needed)


def mb(b: float) -> str:
    return f"{b / 1e6:.3f}"


def tables(rows: list[dict]) -> None:
    out = []
    for r in rows:
        if "R" not in r:
            continue
        R, P = r["R"], r["P"]
        target = 2 * (R - 1) / R * P
        for name, t in sorted(r["processes"].items()):
            worst = max(t["sent"], t["received"])
            ok = "-" if name == "client" else "yes" if worst <= 1.1 * target else "no"
            out.append(
                [
                    r["scenario"],
                    name,
                    mb(t["sent"]),
                    mb(t["received"]),
                    mb(target),
                    f"{worst / target:.2f}",
                    ok,
                ]
            )
    harness.print_table(
        "scenario|process|MB sent/step|MB received/step|2(R-1)/R x P (MB)|max / target|worker within +10%",
        out,
    )
    out = []
    for r in rows:
        if "needed" not in r:
            continue
        total = sum(t["sent"] for t in r["processes"].values())
        per = ", ".join(f"{n} {mb(t['sent'])}/{mb(t['received'])}" for n, t in sorted(r["processes"].items()))
        ratio = total / r["needed"]
        out.append(
            [
                r["scenario"],
                mb(r["needed"]),
                mb(total),
                f"{ratio:.2f}",
                "yes" if ratio <= 1.2 else "no",
                mb(r["P"]),
                per,
            ]
        )
    harness.print_table(
        "scenario|input+labels+boundary+logits (MB)|MB sent/step, all processes|ratio|within 1.2x"
        "|P (MB)|sent/received per process (MB)",
        out,
    )
    out = [[r["scenario"], link, mb(b)] for r in rows for link, b in sorted(r["links"].items()) if b > 1e3]
    harness.print_table("scenario|link|MB/step", out)


def main(argv) -> None:
    del argv
    if FLAGS.child:
        return child()
    if FLAGS.from_json:
        return tables(harness.load_json(FLAGS.from_json)["rows"])
    from tf_gpipe.cluster import LocalCluster

    harness.header("tf_gpipe cluster traffic: bytes per step per worker (loopback TCP counters)")
    with LocalCluster(FLAGS.replicas, devices_per_worker=1, lifetime=1800) as workers:
        pids = [str(workers.pid(t)) for t in range(FLAGS.replicas)]
        rows = harness.child(harness.child_env(tf_config=workers.tf_config), timeout=1500, worker_pids=pids)
    tables(rows)
    harness.finish("traffic_benchmark", rows=rows)


if __name__ == "__main__":
    app.run(main)
