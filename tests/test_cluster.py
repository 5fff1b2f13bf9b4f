"""Stages in other processes through TensorFlow's cluster runtime (tf_gpipe.cluster).

The workers are real ``tf.distribute.Server`` processes on 127.0.0.1 (LocalCluster).
The training client runs in a subprocess (tests/_cluster_worker.py): this pytest
process already initialized TensorFlow with 4 logical CPUs (conftest.py) and must not
connect to a cluster, which would change its context for every later test.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import child_env

import tf_gpipe
from tf_gpipe import cluster
from tf_gpipe.cluster.local import free_port

# One worker runs every test of this module: its module fixture (child processes) runs once.
pytestmark = pytest.mark.xdist_group("cluster_workers")

ROOT = Path(__file__).resolve().parents[1]
CLIENT = ROOT / "tests" / "_cluster_worker.py"
NUM_WORKERS = 2  # each with 2 logical CPUs
STAGES = 4  # equivalence: 2 stages per worker process
# worker_devices: task-major round-robin over the workers' logical CPUs.
DEVICES = [f"/job:worker/replica:0/task:{k % 2}/device:CPU:{k // 2}" for k in range(STAGES)]
CLIENT_ADDRESS = f"127.0.0.1:{free_port()}"  # the first client's own, given to connect
TRAIN = ["train", "--stages=2"]  # fault tests: stage k on worker k (2 stages trace faster)


class Client:
    """A client process whose output lines are read as they come (bounded waits only)."""

    def __init__(self, local: cluster.LocalCluster, *args: str):
        # The stages run on the workers' CPUs; the client's unsplit reference runs on a CPU
        # too (a GPU's TF32 matmuls would differ from them by ~1e-3).
        env = child_env(TF_CONFIG=local.tf_config, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        self.proc = subprocess.Popen(
            [sys.executable, str(CLIENT), *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.lines: list = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith(prefix):
                return line
        self.kill()
        pytest.fail(f"client never printed {prefix!r} within {timeout} s:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"client still running after {timeout} s:\n{self.output[-4000:]}")

    def summary(self, scenario: str, timeout: float = 0) -> dict:
        prefix = f"SUMMARY_{scenario} "
        lines = [line for line in self.lines if line.startswith(prefix)]
        line = lines[-1] if lines else self.wait_for(prefix, timeout)
        return json.loads(line[len(prefix) :])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    # lifetime bounds the processes even if this pytest process is killed outright.
    logs = str(tmp_path_factory.mktemp("workers"))
    local = cluster.LocalCluster(NUM_WORKERS, devices_per_worker=2, lifetime=600, log_dir=logs, start=False)
    try:
        yield local
    finally:
        for task in range(NUM_WORKERS):  # a stopped process only dies of SIGKILL or after SIGCONT
            if local.alive(task):
                os.kill(local.pid(task), signal.SIGCONT)
        local.close()
        assert not any(local.alive(t) for t in range(NUM_WORKERS))


@pytest.fixture(scope="module")
def first_run(workers, tmp_path_factory):
    """One client for the equivalence check and then the first half of the crash test:
    starting TensorFlow is most of a client's cost, so they share a process."""
    tmp = tmp_path_factory.mktemp("first_run")
    client = Client(
        workers,
        f"--client_address={CLIENT_ADDRESS}",
        "equivalence",
        "replicated",
        *TRAIN,
        f"--equivalence_stages={STAGES}",
        f"--ckpt={tmp / 'ckpt'}",
        "--epochs=4",
        "--save_freq=2",
        "--pause_after_step=10",  # epoch 3's second step: saved there, then the crash
        f"--go_file={tmp / 'go'}",
    )
    workers.start()  # the workers start while the client imports TensorFlow
    try:
        yield client, tmp
    finally:
        client.kill()


# ---------------------------------------------------------------------------- no TensorFlow context
def test_cluster_spec_from_every_form(monkeypatch):
    addrs = ["127.0.0.1:1111", "127.0.0.1:2222"]
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": addrs}, "task": {"type": "chief"}}))
    assert cluster.cluster_spec().as_dict() == {"worker": addrs}
    assert cluster.cluster_spec({"worker": addrs}).as_dict() == {"worker": addrs}
    assert cluster.cluster_spec(",".join(addrs)).as_dict() == {"worker": addrs}
    assert cluster.cluster_spec(tf.train.ClusterSpec({"worker": addrs})).as_dict() == {"worker": addrs}
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        cluster.cluster_spec()


def test_worker_devices_names_one_task_per_stage():
    spec = {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]}
    assert cluster.worker_devices(3, cluster=spec) == [
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
        "/job:worker/replica:0/task:0/device:CPU:0",
    ]


def test_flags_pick_local_workers_or_an_address_list(monkeypatch):
    from absl import flags

    fv = flags.FlagValues()
    cluster.define_flags(fv)
    fv(["prog", "--cluster_workers=2"])
    assert fv.cluster_workers == 2 and fv.cluster is None
    fv = flags.FlagValues()
    cluster.define_flags(fv)
    fv(["prog"])
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with cluster.from_flags(fv) as spec:  # nothing given: this process alone, nothing connected
        assert spec is None


def test_connect_gives_up_on_absent_workers_in_bounded_time():
    port = free_port()  # nobody listens there
    start = time.monotonic()
    with pytest.raises(cluster.WorkerFailedError, match=f"task:0 at 127.0.0.1:{port}.*Start each worker"):
        cluster.connect({"worker": [f"127.0.0.1:{port}"]}, timeout=1.0)
    assert time.monotonic() - start < 10


def _no_probes(monkeypatch):
    """Fail the test on any attempt to reach a worker: the addresses below are not to be dialled."""
    import importlib

    module = importlib.import_module("tf_gpipe.cluster.connect")

    def probe(address, timeout):
        raise AssertionError(f"connect sent traffic to {address}")

    monkeypatch.setattr(module, "probe_address", probe)
    monkeypatch.setattr(tf.config, "experimental_connect_to_cluster", probe)
    return module


REMOTE = "10.255.0.7:2222"  # another host's address: never dialled by these tests


def test_connect_refuses_a_loopback_client_when_a_worker_is_remote(monkeypatch):
    _no_probes(monkeypatch)
    local = f"127.0.0.1:{free_port()}"
    monkeypatch.delenv("TF_CONFIG", raising=False)
    fix = r"a 'chief' task in TF_CONFIG .* connect\(\.\.\., address='thishost:2223'\)"
    refusal = rf"no address on loopback \(localhost\).*task:1 is on another host \({REMOTE}\).*{fix}"
    with pytest.raises(ValueError, match=refusal):
        cluster.connect({"worker": [local, REMOTE]}, timeout=1.0)
    with pytest.raises(ValueError, match=rf"'127.0.0.1:2223' on loopback.*{fix}"):
        cluster.connect({"worker": [REMOTE]}, address="127.0.0.1:2223", timeout=1.0)
    chief = {"cluster": {"chief": ["localhost:2223"], "worker": [REMOTE]}, "task": {"type": "chief"}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(chief))
    with pytest.raises(ValueError, match=rf"'localhost:2223' on loopback.*{fix}"):
        cluster.connect(timeout=1.0)


def test_connect_joins_at_the_address_it_is_given(monkeypatch):
    module = _no_probes(monkeypatch)
    spec = tf.train.ClusterSpec({"worker": [REMOTE]})
    joined, job, index = module._client_spec(spec, None, "worker", "10.255.0.9:2223")
    assert joined.as_dict() == {"worker": [REMOTE], "client": ["10.255.0.9:2223"]}
    assert (job, index) == ("client", 0)
    joined, _, _ = module._client_spec(spec, None, "worker", "trainer.example")  # a free port is picked
    assert joined.as_dict()["client"][0].startswith("trainer.example:")
    chief = tf.train.ClusterSpec({"chief": ["10.255.0.9:2223"], "worker": [REMOTE]})
    joined, job, index = module._client_spec(chief, {"type": "chief", "index": 0}, "worker", None)
    assert (joined.as_dict(), job, index) == (chief.as_dict(), "chief", 0)
    with pytest.raises(ValueError, match="Give one of them"):
        module._client_spec(chief, {"type": "chief", "index": 0}, "worker", "10.255.0.8:2223")
    # All on this machine: no address needed (TensorFlow adds job 'client' on localhost).
    here = tf.train.ClusterSpec({"worker": ["127.0.0.1:1"]})
    joined, job, _ = module._client_spec(here, None, "worker", None)
    assert (joined.as_dict(), job) == ({"worker": ["127.0.0.1:1"]}, "client")


# ---------------------------------------------------------------------------- real worker processes
def test_stages_on_worker_processes_match_one_process(workers, first_run):
    client, _ = first_run
    s = client.summary("equivalence", timeout=180)
    assert s["cluster"] == workers.cluster_dict
    assert s["devices"] == DEVICES
    assert s["client_device"] == "/job:client/replica:0/task:0/device:CPU:0"
    assert s["server_cluster"]["client"] == {"0": CLIENT_ADDRESS}  # connect(address=...) is where it listens
    # Every variable of stage k, and every optimizer slot, lives on stage k's worker device.
    for k, device in enumerate(s["devices"]):
        assert s["placement"][str(k)] == [device], s["placement"]
    assert s["stage_tasks"] == [0, 1, 0, 1]
    assert s["slot_devices"] and set(s["slot_devices"].values()) == set(s["devices"])
    # Same numbers as keras.Sequential with the same weights in one process.
    assert s["max_output_diff"] < 1e-5 and s["max_grad_diff"] < 1e-5, s
    np.testing.assert_allclose(s["loss_pm"], s["loss_seq"], rtol=1e-5)
    assert s["max_weight_diff_after_fit"] < 1e-4 and s["max_weight_change"] > 1e-2, s
    assert s["loop_builds"] >= 1  # fit's step ran as the loops over micro-batches (the default here)
    # Where fit's step ran (its partition graphs), as docs/cluster.md "What runs where" says.
    ops, client = s["op_devices"], s["client_device"]
    matmuls = {d for op, devices in ops.items() if "MatMul" in op for d in devices}  # oneDNN's too
    assert matmuls == set(DEVICES), ops  # each stage's forward and backward
    assert ops["SparseSoftmaxCrossEntropyWithLogits"] == [DEVICES[-1]]  # the loss: last stage
    assert ops["IteratorGetNext"] == [client]  # the input pipeline
    assert ops["SplitV"] == [client]  # cutting the batch into micro-batches
    assert set(ops["adam:AssignSubVariableOp"]) == set(DEVICES)  # the writes into the variables
    # The whole update, its arithmetic too, on the stages' workers (tf_gpipe/update.py).
    adam = {op: devices for op, devices in ops.items() if op.startswith("adam:")}
    assert len(adam) > 5 and not [op for op, devices in adam.items() if client in devices], adam


def test_data_x_pipeline_replicas_on_two_workers(first_run):
    client, _ = first_run
    s = client.summary("replicated", timeout=180)
    # Replica r is a 2-stage pipeline on worker r's two CPUs; the all-reduce crosses processes.
    want = [[f"/job:worker/replica:0/task:{r}/device:CPU:{k}" for k in range(2)] for r in range(2)]
    assert s["placement"] == want
    assert s["max_replica_diff"] == 0.0, s  # the same averaged gradient and update on every copy
    assert s["max_diff_vs_sequential"] < 1e-5, s  # = one model on the 2x larger batch
    np.testing.assert_allclose(s["loss_replicated"], s["loss_sequential"], rtol=1e-5)
    assert s["loop_builds"] >= 2  # each replica's part of the step ran as the loops
    # R=4 replicas of one stage, two on each worker: the ring crosses processes both ways.
    four = s["4x1"]
    assert four["placement"] == [[d] for d in DEVICES], four
    assert four["max_replica_diff"] == 0.0, four
    assert four["max_diff_vs_sequential"] < 1e-5, four
    np.testing.assert_allclose(four["loss_replicated"], four["loss_sequential"], rtol=1e-5)


def test_data_x_pipeline_in_one_process(cpu_devices):
    """The same on the 4 logical CPUs of this process (no cluster): R=2 x K=2."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(64, 8).astype("float32"), rng.randint(0, 3, 64)

    def make():
        keras.utils.set_random_seed(3)
        return [
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ]

    rp = cluster.ReplicatedPipeline(
        make, [cpu_devices[0:2], cpu_devices[2:4]], input_shape=(None, 8), num_micro_batches=2
    )
    one = tf_gpipe.PipelineModel(make(), devices=cpu_devices[0:2], num_micro_batches=2)
    one.build((None, 8))
    one.set_weights(rp.replicas[0].get_weights())
    for model in (rp, one):
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rp.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)  # 16 examples per replica
    one.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    w0, w1 = rp.replicas[0].get_weights(), rp.replicas[1].get_weights()
    for a, b, c in zip(w0, w1, one.get_weights()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
    placed = {tf.DeviceSpec.from_string(v.value.device) for v in rp.replicas[1].trainable_variables}
    assert {(d.device_type, d.device_index) for d in placed} == {("CPU", 2), ("CPU", 3)}
    slots = {v.value.device for v in rp.optimizer.variables if "dense" in v.path}
    assert len(slots) == 4  # each slot on its own replica's stage device
    with pytest.raises(ValueError, match="equal replica shards"):
        rp.train_on_batch(x[:31], y[:31])


def test_resume_inside_an_epoch_matches_an_uninterrupted_run(cpu_devices, tmp_path):
    """save_freq=2, stopped after step 9 of 2 epochs x 6: the restart trains steps 9-12 only."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(72, 8).astype("float32"), rng.randint(0, 3, 72)

    def make():
        keras.utils.set_random_seed(1)
        layers = [keras.layers.Dense(16, activation="tanh"), keras.layers.Dropout(0.25, seed=5)]
        model = tf_gpipe.PipelineModel(layers + [keras.layers.Dense(3)], devices=cpu_devices[:2])
        model.build((None, 8))
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    class StopAfter(keras.callbacks.Callback):
        def __init__(self, steps):
            super().__init__()
            self.steps, self.seen = steps, 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == self.steps:
                raise KeyboardInterrupt  # as a kill would: no epoch end, no train end

    def fit(model, *callbacks):
        model.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))

    reference = make()
    fit(reference)
    with pytest.raises(KeyboardInterrupt):
        fit(make(), cluster.ResumableCheckpoint(str(tmp_path), save_freq=2), StopAfter(9))
    resumed, resume = make(), cluster.ResumableCheckpoint(str(tmp_path), save_freq=2)
    fit(resumed, resume)
    assert (resume.restored_epoch, resume.restored_batch) == (1, 2)  # saved after step 8
    assert int(resumed.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 12
    for got, want in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"save_freq=0.*a positive number of steps"):
        cluster.ResumableCheckpoint(str(tmp_path), save_freq=0)


def test_dead_worker_clear_error_then_resume_matches_uninterrupted_run(workers, first_run, tmp_path):
    run1, tmp = first_run
    go, ckpt = tmp / "go", tmp / "ckpt"
    run1.wait_for("PAUSED", 180)
    workers.kill(1)  # a crash: the connection is refused from now on
    start = time.monotonic()
    go.touch()
    assert run1.wait(60) == 3, run1.output[-4000:]
    elapsed = time.monotonic() - start
    failed = run1.wait_for("WORKER_FAILED", 1)
    assert f"/job:worker/replica:0/task:1 ({workers.addresses[1]})" in failed, failed
    assert "restart that worker" in failed and "last checkpoint" in failed, failed
    print(f"dead worker: WorkerFailedError {elapsed:.1f} s after the crash:\n{failed}")
    assert elapsed < 30, elapsed

    # Restart the worker and the script: it resumes after step 10 and ends where a run
    # that was never interrupted ends (same cluster, same data, fresh checkpoint dir).
    # In the documented order: the worker first, then the script. (Started the other way
    # round, the client could connect while the worker was still coming up and fail with
    # UnavailableError in training: seen once in CI.)
    workers.restart(1)
    run2 = Client(
        workers,
        *TRAIN,
        f"--ckpt={ckpt}",
        "--epochs=4",
        "--save_freq=2",
        f"--reference_ckpt={tmp_path / 'reference'}",
    )
    assert run2.wait(180) == 0, run2.output[-4000:]
    s = run2.summary("train")
    assert (s["restored_epoch"], s["restored_batch"]) == (2, 2)  # after step 10, inside epoch 3
    assert s["iterations"] == s["reference_iterations"] == 4 * 4  # 96 examples / 24 per batch
    for got, want in zip(s["weights"], s["reference_weights"]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert s["placement"] == [[d] for d in DEVICES[:2]]


def test_hung_worker_ends_the_client_in_bounded_time(workers, tmp_path):
    go = tmp_path / "go"
    client = Client(
        workers,
        *TRAIN,
        f"--ckpt={tmp_path / 'ckpt'}",
        "--epochs=3",
        "--pause_after=1",
        f"--go_file={go}",
        "--grace=3",
    )
    workers.start()  # restarts any worker a test above broke, while the client starts
    client.wait_for("PAUSED", 150)
    os.kill(workers.pid(0), signal.SIGSTOP)  # alive but silent: TCP still accepts, nothing answers
    start = time.monotonic()
    go.touch()
    try:
        code = client.wait(60)
    finally:
        workers.kill(0)
    elapsed = time.monotonic() - start
    assert code == 75, client.output[-4000:]
    assert f"/job:worker/replica:0/task:0 ({workers.addresses[0]}) stopped answering" in client.output
    assert "no answer within" in client.output and "restart that worker" in client.output
    print(f"hung worker: client exited {elapsed:.1f} s after the worker stopped:\n{client.output[-900:]}")
    assert elapsed < 30, elapsed  # probe_timeout 2 s + grace 3 s, plus the process teardown
