"""Stages on other machines: TensorFlow's own cluster runtime (gRPC servers, ClusterSpec, TF_CONFIG).

A pipeline stage on another host is just a device string such as
``"/job:worker/replica:0/task:1/device:CPU:0"``: once this process is connected to
the cluster (``connect``), TensorFlow lists the workers' devices, ``PipelineModel``
creates each stage's variables there and the schedule's ops run there; the tensors
between stages travel over TensorFlow's gRPC runtime. Nothing here moves tensors
itself. Around that:

* ``LocalCluster`` starts worker processes on 127.0.0.1 (tests, demos, benchmarks);
* ``WorkerWatch`` (``watch_workers``) turns a dead or hung worker into a clear error
  in bounded time, and ``ResumableCheckpoint`` lets the restarted script resume;
* ``ReplicatedPipeline`` runs R copies of a pipeline on disjoint devices with
  all-reduced gradients (data x pipeline parallelism).

Example:

```python
from tf_gpipe import cluster
with cluster.LocalCluster(2) as workers:        # or: export TF_CONFIG on real hosts
    cluster.connect(workers)
    model = tf_gpipe.PipelineModel(layers, devices=cluster.worker_devices(2),
                                   num_micro_batches=4)
    model.build((None, 32))
    model.compile(optimizer="adam", loss="mse")
    with cluster.watch_workers(workers) as watch:
        model.fit(x, y, epochs=2, callbacks=[watch, cluster.ResumableCheckpoint("ckpt")])
```

A worker on a real host runs ``python -m tf_gpipe.cluster --worker --task_index=K
--cluster='{"worker": ["host0:2222", "host1:2222"]}'`` (or reads ``TF_CONFIG``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import keras
import tensorflow as tf
from tensorflow.python.eager import context as _context

__all__ = [
    "LocalCluster",
    "ReplicatedPipeline",
    "ResumableCheckpoint",
    "WorkerFailedError",
    "WorkerWatch",
    "client_device",
    "cluster_spec",
    "connect",
    "define_flags",
    "from_flags",
    "serve",
    "watch_workers",
    "worker_devices",
]

ClusterLike = Union[None, str, dict, tf.train.ClusterSpec, "LocalCluster"]
_READY = "TF_GPIPE_WORKER_READY"
_CLIENT_JOB = "client"
_LIVE_CLUSTERS: "weakref.WeakSet[LocalCluster]" = weakref.WeakSet()


# ---------------------------------------------------------------------------- cluster specs
def _parse(cluster: ClusterLike) -> tuple:
    """``(ClusterSpec, task dict or None)`` from any accepted cluster description."""
    if isinstance(cluster, LocalCluster):
        return cluster.cluster_spec, None
    if isinstance(cluster, tf.train.ClusterSpec):
        return cluster, None
    if cluster is None:
        text = os.environ.get("TF_CONFIG")
        if not text:
            raise ValueError(
                "tf_gpipe: no cluster given and TF_CONFIG is not set. Pass a dict such as "
                "{'worker': ['host0:2222', 'host1:2222']}, a tf.train.ClusterSpec, or export "
                'TF_CONFIG=\'{"cluster": {"worker": [...]}}\'.'
            )
        cluster = text
    if isinstance(cluster, str):
        text = cluster.strip()
        if text.startswith("{"):
            cluster = json.loads(text)
        else:  # "host:port,host:port": one worker job
            cluster = {"worker": [a.strip() for a in text.split(",") if a.strip()]}
    if not isinstance(cluster, dict):
        raise TypeError(f"tf_gpipe: cannot read a cluster from {type(cluster).__name__}.")
    task = None
    if "cluster" in cluster:  # TF_CONFIG shape
        task = cluster.get("task") or None
        cluster = cluster["cluster"]
    return tf.train.ClusterSpec(cluster), task


def cluster_spec(cluster: ClusterLike = None) -> tf.train.ClusterSpec:
    """The ``tf.train.ClusterSpec`` of ``cluster``: TF_CONFIG (None), a JSON string, a
    ``"host:port,host:port"`` list of workers, a dict, a ClusterSpec or a LocalCluster."""
    return _parse(cluster)[0]


def _addresses(spec: tf.train.ClusterSpec, job: str) -> Dict[int, str]:
    if job not in spec.jobs:
        raise ValueError(
            f"tf_gpipe: the cluster has no job {job!r}; its jobs are {spec.jobs}. "
            f"Name the workers' job with job_name=..."
        )
    return {i: spec.task_address(job, i) for i in spec.task_indices(job)}


def _wait_answering(addresses: Dict[int, str], job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    missing = dict(addresses)
    while missing:
        left = max(0.5, min(5.0, deadline - time.monotonic()))
        missing = {i: a for i, a in missing.items() if _probe(a, left) is not None}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if missing:
        names = ", ".join(f"/job:{job}/replica:0/task:{i} at {a}" for i, a in missing.items())
        raise WorkerFailedError(
            f"tf_gpipe: no TensorFlow server answers for {names} after {timeout:.0f} s. Start "
            f"each worker first (python -m tf_gpipe.cluster --worker --task_index=K "
            f"--cluster=...), check the addresses and firewalls, then run this script again."
        )


def connect(
    cluster: ClusterLike = None,
    job_name: str = "worker",
    protocol: str = "grpc",
    *,
    timeout: float = 60.0,
) -> tf.train.ClusterSpec:
    """Connect this process to a TensorFlow cluster so its devices can hold stages.

    Waits (at most ``timeout`` seconds) until the TensorFlow server of every task of
    job ``job_name`` answers, then calls ``tf.config.experimental_connect_to_cluster``.
    This process joins as the task that ``TF_CONFIG["task"]`` names when that is not
    a ``job_name`` task, else as job ``"client"`` (TensorFlow picks it a free port).
    Afterwards ``tf.config.list_logical_devices()`` includes the workers' devices.

    Call it once, at the top of the program: reconnecting invalidates every tensor
    and variable already placed on the workers.

    Args:
        cluster: TF_CONFIG (None), a dict ``{"worker": ["host:port", ...]}`` or a
            TF_CONFIG-shaped dict, a JSON string, a ``tf.train.ClusterSpec`` or a
            ``LocalCluster``.
        job_name: the job whose tasks run the stages.
        protocol: the RPC protocol of the workers' servers.
        timeout: seconds to wait for the workers to come up.

    Returns:
        The cluster's ``tf.train.ClusterSpec`` (without this client's own job).
    """
    spec, task = _parse(cluster)
    _wait_answering(_addresses(spec, job_name), job_name, timeout)
    client_job, client_index = _CLIENT_JOB, 0
    if task and task.get("type") not in (None, job_name):
        client_job, client_index = task["type"], int(task.get("index", 0))
    elif task and task.get("type") == job_name:
        raise ValueError(
            f"tf_gpipe: TF_CONFIG says this process is {job_name} task {task.get('index', 0)}; "
            "a worker serves devices (python -m tf_gpipe.cluster --worker), the training "
            "script runs as another task (e.g. 'chief') or with no task at all."
        )
    tf.config.experimental_connect_to_cluster(
        spec, job_name=client_job, task_index=client_index, protocol=protocol
    )
    return spec


def client_device() -> str:
    """This process's own CPU after ``connect``: where to read data and write checkpoints.

    Pass it as ``tf.train.CheckpointOptions(experimental_io_device=client_device())`` so a
    checkpoint of variables on remote workers is written by this process, to its own disk.
    """
    server_def = _context.get_server_def()
    if server_def is None:
        return "/job:localhost/replica:0/task:0/device:CPU:0"
    return f"/job:{server_def.job_name}/replica:0/task:{server_def.task_index}/device:CPU:0"


def worker_devices(
    num: int, job: str = "worker", device_type: str = "CPU", cluster: ClusterLike = None
) -> List[str]:
    """``num`` device strings on the tasks of ``job``, one per stage, task-major round-robin.

    With a connected cluster: device 0 of task 0, device 0 of task 1, ..., then
    device 1 of each task, and so on. Before ``connect`` (or with ``cluster`` given),
    stage ``k`` gets ``/job:{job}/replica:0/task:{k % tasks}/device:{device_type}:0``.
    """
    device_type = device_type.upper()
    tasks: Optional[int] = None
    if cluster is not None:
        tasks = len(_addresses(cluster_spec(cluster), job))
    found: Dict[int, List[tf.DeviceSpec]] = {}
    if tasks is None:
        for d in tf.config.list_logical_devices(device_type):
            s = tf.DeviceSpec.from_string(d.name)
            if s.job == job:
                found.setdefault(s.task, []).append(s)
    if found:
        per_task = [sorted(found[t], key=lambda s: s.device_index) for t in sorted(found)]
        pool = [ds[i].to_string() for i in range(max(map(len, per_task))) for ds in per_task if i < len(ds)]
    else:
        pool = [f"/job:{job}/replica:0/task:{t}/device:{device_type}:0" for t in range(tasks or num)]
    return [pool[k % len(pool)] for k in range(num)]


# ---------------------------------------------------------------------------- local cluster
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


class LocalCluster:
    """Start ``num_workers`` TensorFlow servers as processes on 127.0.0.1; stop them after.

    Each worker is ``python -m tf_gpipe.cluster --worker``: a ``tf.distribute.Server``
    on a free loopback port, exactly what a worker on another host runs. The
    processes stop when the cluster is closed (``with`` block, ``close()``, interpreter
    exit) and, should this process die without closing, by themselves: each worker
    exits once its parent is gone, and after ``lifetime`` seconds if given.

    Args:
        num_workers: worker processes (tasks of job ``job_name``).
        job_name: the workers' job.
        devices_per_worker: logical CPU devices each worker exposes.
        threads: intra- and inter-op threads of each worker (0: TensorFlow's default).
        startup_timeout: seconds to wait for every worker to listen.
        lifetime: seconds after which a worker exits on its own (None: no limit).
        log_dir: where ``worker-K.log`` go (default: a new temporary directory).

    Example:

    ```python
    with LocalCluster(2) as workers:
        os.environ["TF_CONFIG"] = workers.tf_config   # for a training script started here
        subprocess.run([sys.executable, "train.py"], check=True, timeout=600)
    ```
    """

    def __init__(
        self,
        num_workers: int,
        job_name: str = "worker",
        devices_per_worker: int = 1,
        threads: int = 0,
        startup_timeout: float = 60.0,
        lifetime: Optional[float] = None,
        log_dir: Optional[str] = None,
        start: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"tf_gpipe: num_workers must be >= 1, got {num_workers}.")
        self.job_name = job_name
        self.devices_per_worker = devices_per_worker
        self.threads = threads
        self.startup_timeout = startup_timeout
        self.lifetime = lifetime
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tf_gpipe_cluster_")
        self.addresses = [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)]
        self._procs: List[Optional[subprocess.Popen]] = [None] * num_workers
        self._closed = False
        _LIVE_CLUSTERS.add(self)
        atexit.register(self.close)
        if start:
            self.start()

    # -- descriptions a client needs
    @property
    def num_workers(self) -> int:
        return len(self.addresses)

    @property
    def cluster_dict(self) -> Dict[str, List[str]]:
        return {self.job_name: list(self.addresses)}

    @property
    def cluster_spec(self) -> tf.train.ClusterSpec:
        return tf.train.ClusterSpec(self.cluster_dict)

    @property
    def tf_config(self) -> str:
        """``TF_CONFIG`` for a client of this cluster (the client joins as job 'client')."""
        return json.dumps({"cluster": self.cluster_dict})

    def log(self, task: int) -> str:
        return os.path.join(self.log_dir, f"worker-{task}.log")

    def pid(self, task: int) -> Optional[int]:
        proc = self._procs[task]
        return None if proc is None else proc.pid

    def alive(self, task: int) -> bool:
        proc = self._procs[task]
        return proc is not None and proc.poll() is None

    # -- lifecycle
    def _launch(self, task: int) -> subprocess.Popen:
        argv = [
            sys.executable,
            "-m",
            "tf_gpipe.cluster",
            "--worker",
            f"--cluster={json.dumps(self.cluster_dict)}",
            f"--job_name={self.job_name}",
            f"--task_index={task}",
            f"--virtual_cpus={self.devices_per_worker}",
            f"--threads={self.threads}",
            f"--parent_pid={os.getpid()}",
        ]
        if self.lifetime:
            argv.append(f"--lifetime={self.lifetime}")
        env = dict(os.environ)
        env.pop("TF_CONFIG", None)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        with open(self.log(task), "w") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL, cwd=root
            )

    def start(self, tasks: Optional[Sequence[int]] = None) -> "LocalCluster":
        """Start the given tasks (default: all not running) and wait until they listen."""
        if self._closed:
            raise RuntimeError("tf_gpipe: this LocalCluster is closed; make a new one.")
        tasks = [t for t in (range(self.num_workers) if tasks is None else tasks) if not self.alive(t)]
        for t in tasks:
            self._procs[t] = self._launch(t)
        deadline = time.monotonic() + self.startup_timeout
        try:
            for t in tasks:
                while _READY not in _tail(self.log(t), 10**6):
                    if self._procs[t].poll() is not None:
                        raise RuntimeError(
                            f"tf_gpipe: local worker {t} ({self.addresses[t]}) exited with code "
                            f"{self._procs[t].returncode} while starting; its log "
                            f"{self.log(t)} ends with:\n{_tail(self.log(t))}"
                        )
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"tf_gpipe: local worker {t} ({self.addresses[t]}) did not start within "
                            f"{self.startup_timeout:.0f} s; its log {self.log(t)} ends with:\n"
                            f"{_tail(self.log(t))}"
                        )
                    time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def kill(self, task: int) -> None:
        """SIGKILL one worker, as a crash would (for fault-tolerance tests)."""
        proc = self._procs[task]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def restart(self, task: int) -> None:
        """Start a fresh worker ``task`` on the same address (after a crash or ``kill``)."""
        self.kill(task)
        self.start([task])

    def close(self, grace: float = 5.0) -> None:
        """Stop every worker: SIGTERM, then SIGKILL those still alive after ``grace`` s."""
        if self._closed:
            return
        self._closed = True
        live = [p for p in self._procs if p is not None and p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        atexit.unregister(self.close)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"alive={[self.alive(t) for t in range(self.num_workers)]}"
        return f"LocalCluster({self.cluster_dict}, {state})"


# ---------------------------------------------------------------------------- failures
class WorkerFailedError(RuntimeError):
    """A worker holding pipeline stages died or stopped answering."""


def _probe(address: str, timeout: float) -> Optional[str]:
    """None if the TensorFlow server at ``address`` answers within ``timeout`` s, else why not.

    Asks the server's own ``WorkerService/GetStatus`` (a health check, not a transport):
    a crashed worker refuses the connection at once; a stopped or cut-off one never
    answers, which only a deadline can tell.
    """
    import grpc  # a TensorFlow dependency

    channel = grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
    try:
        channel.unary_unary("/tensorflow.WorkerService/GetStatus")(b"", timeout=timeout)
        return None
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"no answer within {timeout:g} s (the process is hung, stopped, or cut off)"
        return f"{e.code().name}: {e.details()}"
    finally:
        channel.close()


_REMOTE = re.compile(r"/job:(\w+)/replica:0/task:(\d+)")


class WorkerWatch(keras.callbacks.Callback):
    """Turn a dead or hung worker into a clear error within a bounded time.

    Use as a context manager around training (and, for ``step_timeout``, also as a
    Keras callback). A thread asks every worker's TensorFlow server for its status
    every ``probe_interval`` seconds. When a worker dies, TensorFlow itself usually
    fails the running step with ``UnavailableError`` at once; leaving the block, that
    error becomes a ``WorkerFailedError`` naming the worker and the way back. When
    a worker hangs instead (stopped process, lost host, cut network), the step waits
    inside TensorFlow's runtime, where Python cannot cancel it: once the worker has
    not answered for ``probe_timeout`` s and the block is still running ``grace`` s
    later (and still does not answer), the watch prints the same diagnosis and ends
    the process with ``exit_code`` (75, EX_TEMPFAIL: "restart me"), after stopping
    the workers of any ``LocalCluster`` this process started. ``probe_timeout``
    must exceed the time a busy worker can take to answer (its longest op).

    Args:
        cluster: as for ``connect`` (default: TF_CONFIG).
        job_name: the job whose tasks hold stages.
        probe_interval: seconds between health checks.
        probe_timeout: seconds a worker may take to answer one.
        grace: seconds the main thread gets to fail by itself; a worker that still
            does not answer then means a hang.
        step_timeout: if set, a training batch (seen through the callback) that takes
            longer counts as a hang too, even if every worker answers.
        exit_code: the process exit status after a hang; None only prints the
            diagnosis (the step may then wait forever).

    Example:

    ```python
    with cluster.watch_workers(step_timeout=600) as watch:
        model.fit(x, y, epochs=10, callbacks=[watch, resume])
    ```
    """

    def __init__(
        self,
        cluster: ClusterLike = None,
        job_name: str = "worker",
        probe_interval: float = 2.0,
        probe_timeout: float = 10.0,
        grace: float = 15.0,
        step_timeout: Optional[float] = None,
        exit_code: Optional[int] = 75,
    ):
        super().__init__()
        self.job_name = job_name
        self.addresses = _addresses(cluster_spec(cluster), job_name)
        self.probe_interval, self.probe_timeout = probe_interval, probe_timeout
        self.grace, self.step_timeout, self.exit_code = grace, step_timeout, exit_code
        self.failure: Optional[str] = None
        self._failed_at = 0.0
        self._step_started: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _name(self, task: int) -> str:
        return f"/job:{self.job_name}/replica:0/task:{task} ({self.addresses[task]})"

    def _message(self, what: str, task: Optional[int]) -> str:
        again = (
            f"restart that worker (python -m tf_gpipe.cluster --worker --job_name={self.job_name} "
            f"--task_index={task} --cluster=... on its host)"
            if task is not None
            else "check that every worker runs and answers"
        )
        return (
            f"tf_gpipe: {what}. The pipeline cannot go on without the stages it holds. "
            f"To recover: {again}, then start this training script again; it resumes from its "
            "last checkpoint (tf_gpipe.cluster.ResumableCheckpoint or your tf.train.CheckpointManager)."
        )

    def diagnose(self) -> Optional[str]:
        """Probe every worker now; the error message for the first that fails, else None."""
        for task in sorted(self.addresses):
            why = _probe(self.addresses[task], self.probe_timeout)
            if why is not None:
                return self._message(f"worker {self._name(task)} stopped answering: {why}", task)
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.probe_interval):
            started = self._step_started
            if self.failure is None:
                self.failure, self._failed_at = self.diagnose(), time.monotonic()
            if self.failure is None and self.step_timeout and started:
                late = time.monotonic() - started
                if late > self.step_timeout:
                    self.failure = self._message(
                        f"a training step has not finished after {late:.0f} s "
                        f"(step_timeout={self.step_timeout:g}) although every worker answers",
                        None,
                    )
                    self._abort()
            if self.failure is not None and time.monotonic() - self._failed_at >= self.grace:
                # The main thread did not fail by itself: hung. Unless the worker is back
                # (a probe lost to a busy moment), nothing will ever end the step.
                self.failure = self.diagnose()
                if self.failure is None:
                    continue
                self._abort()

    def _abort(self) -> None:
        if self._stop.is_set() or self.exit_code is None:
            if self.exit_code is None:
                sys.stderr.write(f"\n{self.failure}\n")
            return
        sys.stderr.write(
            f"\n{self.failure}\nThe step is blocked inside TensorFlow and cannot be "
            f"cancelled from Python: exiting with code {self.exit_code}.\n"
        )
        sys.stderr.flush()
        sys.stdout.flush()
        for local in list(_LIVE_CLUSTERS):
            local.close(grace=1.0)
        os._exit(self.exit_code)

    def start(self) -> "WorkerWatch":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="tf_gpipe-worker-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.probe_timeout * (len(self.addresses) + 1))
            self._thread = None

    def __enter__(self) -> "WorkerWatch":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()
        if not isinstance(exc, tf.errors.OpError):
            return
        failure = self.failure or self.diagnose()
        if failure is None and isinstance(exc, (tf.errors.UnavailableError, tf.errors.AbortedError)):
            tasks = [int(t) for j, t in _REMOTE.findall(str(exc)) if j == self.job_name]
            task = tasks[-1] if tasks else None
            failure = self._message(
                f"the connection to worker {self._name(task) if task is not None else '(unknown)'} "
                f"failed ({type(exc).__name__})",
                task,
            )
        if failure is not None:
            raise WorkerFailedError(failure) from exc

    # Keras callback hooks: a batch in flight is what step_timeout measures.
    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._step_started = time.monotonic()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._step_started = None


def watch_workers(cluster: ClusterLike = None, job_name: str = "worker", **kwargs: Any) -> WorkerWatch:
    """A ``WorkerWatch`` over the workers of ``cluster`` (see there for the arguments)."""
    return WorkerWatch(cluster, job_name, **kwargs)


# ---------------------------------------------------------------------------- checkpoints
class ResumableCheckpoint(keras.callbacks.Callback):
    """Save model and optimizer every epoch; a restarted ``fit`` resumes from the last save.

    A ``tf.train.CheckpointManager`` of ``tf.train.Checkpoint(model, optimizer, every
    model variable, epoch)``, written through this process's CPU (``client_device()``),
    so variables on remote workers land in ``directory`` on this machine. On
    ``fit``, the latest checkpoint, if any, is restored and training goes on with the
    epoch after it (build the model before ``fit``). The same data order
    (``shuffle=False`` or a seeded dataset) then gives the same result as a run that
    was never interrupted.

    Args:
        directory: where the checkpoints go.
        max_to_keep: how many to keep.
    """

    def __init__(self, directory: str, max_to_keep: int = 2):
        super().__init__()
        self.directory, self.max_to_keep = directory, max_to_keep
        self.manager: Optional[tf.train.CheckpointManager] = None
        self.restored_epoch = 0
        self._epoch: Optional[tf.Variable] = None

    def _options(self) -> tf.train.CheckpointOptions:
        return tf.train.CheckpointOptions(experimental_io_device=client_device())

    def on_train_begin(self, logs: Any = None) -> None:
        model = self.model
        if not model.built:
            raise ValueError(
                "tf_gpipe: ResumableCheckpoint restores variables before the first step, so the "
                "model must exist first: call model.build(input_shape) (or the model on a batch) "
                "before fit, as for keras.callbacks.BackupAndRestore."
            )
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # slots exist before restoring
        if self.manager is None:
            with tf.init_scope(), tf.device(client_device()):
                self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
            # model.variables adds what tf.train.Checkpoint(model) misses (e.g. dropout seeds).
            ckpt = tf.train.Checkpoint(
                model=model, optimizer=model.optimizer, variables=list(model.variables), epoch=self._epoch
            )
            self.manager = tf.train.CheckpointManager(ckpt, self.directory, self.max_to_keep)
        latest = self.manager.latest_checkpoint
        if latest:
            self.manager.checkpoint.restore(latest, options=self._options()).assert_existing_objects_matched()
            self.restored_epoch = int(self._epoch.numpy())
            model._initial_epoch = self.restored_epoch  # what keras.callbacks.BackupAndRestore sets

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._epoch.assign(epoch + 1)
        self.manager.save(checkpoint_number=epoch + 1, options=self._options())

    def on_train_end(self, logs: Any = None) -> None:
        self.model._initial_epoch = None  # Keras never resets it: a later fit would skip epochs


# ---------------------------------------------------------------------------- data x pipeline
class ReplicatedPipeline(keras.Model):
    """Data x pipeline parallelism: R copies of one pipeline on disjoint devices.

    Replica ``r`` is a ``PipelineModel`` of fresh layers from ``make_layers()`` on the
    devices ``device_groups[r]``; all start from replica 0's weights. A training step
    cuts the global batch into R equal shards, each replica computes its shard's loss
    and gradients through its own pipeline (micro-batches, re-materialization),
    ``tf.distribute.ReductionToOneDevice`` averages each variable's R gradients and
    sends the mean back to every replica's device (an all-reduce through TensorFlow's
    runtime), and one optimizer applies the same update to every copy: the replicas
    stay identical, and the step equals one pipeline's step on the whole batch (for
    losses that average over examples; BatchNormalization statistics and dropout
    masks are per shard). ``predict``/``evaluate`` run replica 0.

    Args:
        make_layers: returns a new list of layers (same architecture) on each call.
        device_groups: one device list per replica, ``K`` devices each, all disjoint.
        input_shape: builds the replicas and copies replica 0's weights to the rest now;
            otherwise call ``build(input_shape)`` before training.
        **pipeline_kwargs: ``num_micro_batches``, ``remat``, ... for every replica.

    Example:

    ```python
    groups = [cluster.worker_devices(4)[0::2], cluster.worker_devices(4)[1::2]]
    model = cluster.ReplicatedPipeline(make_layers, groups, input_shape=(None, 32),
                                       num_micro_batches=4)
    model.compile(optimizer="adam", loss="mse")
    model.fit(x, y, batch_size=128)     # 64 examples per replica
    ```
    """

    def __init__(
        self,
        make_layers: Callable[[], Sequence[keras.layers.Layer]],
        device_groups: Sequence[Sequence[str]],
        input_shape: Optional[Sequence[Optional[int]]] = None,
        **pipeline_kwargs: Any,
    ):
        from tf_gpipe.model import PipelineModel

        super().__init__()
        groups = [list(g) for g in device_groups]
        flat = [d for g in groups for d in g]
        if len(groups) < 1 or len(set(flat)) != len(flat):
            raise ValueError(
                f"tf_gpipe: device_groups must be one or more disjoint device lists, got {groups}; "
                "e.g. [devices[0::2], devices[1::2]] for 2 replicas over 2K devices."
            )
        self.replicas = [PipelineModel(make_layers(), devices=g, **pipeline_kwargs) for g in groups]
        self._cross_device = tf.distribute.ReductionToOneDevice()
        if input_shape is not None:
            self.build(input_shape)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def build(self, input_shape: Any) -> None:
        """Build every replica on its devices and give them replica 0's weights."""
        for replica in self.replicas:
            replica.build(input_shape)
        weights = self.replicas[0].get_weights()
        for replica in self.replicas[1:]:
            replica.set_weights(weights)
        self.built = True

    def call(self, inputs: Any, training: Optional[bool] = None) -> Any:
        return self.replicas[0](inputs, training=training)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        from tf_gpipe.trainer import colocate_slots

        kwargs["jit_compile"] = False  # XLA would ignore the stage placement
        super().compile(*args, **kwargs)
        colocate_slots(self.optimizer)  # each slot on its variable's (replica's) device

    def _all_reduce_mean(self, grads: List[List[Any]]) -> List[List[Any]]:
        from tensorflow.python.distribute import values as _values  # PerReplica: no public constructor

        per_var = [_values.PerReplica(tuple(g[i] for g in grads)) for i in range(len(grads[0]))]
        reduced = self._cross_device.batch_reduce(
            tf.distribute.ReduceOp.MEAN, [(v, v) for v in per_var]
        )  # destination = the replicas' own devices: the mean comes back to each of them
        return [[m.values[r] for m in reduced] for r in range(self.num_replicas)]

    def train_step(self, data: Any) -> dict:
        from keras.src.trainers.data_adapters import data_adapter_utils

        if not self.built:
            raise ValueError(
                "tf_gpipe: build the ReplicatedPipeline first (input_shape=... or "
                "model.build(input_shape)) so that every replica starts from the same weights."
            )
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        R = self.num_replicas
        batch = x.shape[0]
        if batch is not None and batch % R:
            raise ValueError(
                f"tf_gpipe: a batch of {batch} does not split into {R} equal replica shards; "
                f"use a batch_size divisible by {R} (and drop_remainder=True for datasets)."
            )
        shards = [tf.split(t, R) if t is not None else [None] * R for t in (x, y, sample_weight)]
        grads, outs, losses = [], [], []
        for r, replica in enumerate(self.replicas):
            xr, yr, swr = (shards[0][r], shards[1][r], shards[2][r])
            with tf.GradientTape() as tape:
                out = replica(xr, training=True)
                loss = self._compile_loss(yr, out, swr)
                if replica.losses:  # weight regularizers, activity regularizers
                    loss = loss + tf.add_n(replica.losses)
            grads.append(tape.gradient(loss, replica.trainable_variables))
            outs.append(out)
            losses.append(loss)
        mean = self._all_reduce_mean(grads)
        pairs = [zip(mean[r], replica.trainable_variables) for r, replica in enumerate(self.replicas)]
        self.optimizer.apply_gradients([pair for replica_pairs in pairs for pair in replica_pairs])
        loss = tf.add_n(losses) / R
        self._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
        return self.compute_metrics(x, y, tf.concat(outs, 0), sample_weight=sample_weight)


# ---------------------------------------------------------------------------- flags
def define_flags(flag_values: Any = None) -> None:
    """Declare ``--cluster`` and ``--cluster_workers`` (absl) for a training script."""
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values  # an empty FlagValues is falsy
    flags.DEFINE_string(
        "cluster",
        None,
        "Workers that hold the stages: 'host:port,host:port' or a cluster JSON "
        '({"worker": [...]}). Default: TF_CONFIG if set, else this process alone.',
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "cluster_workers",
        0,
        "Start this many worker processes on 127.0.0.1 for the run (a demo of --cluster "
        "on one machine); 0: none.",
        flag_values=fv,
    )


@contextlib.contextmanager
def from_flags(flag_values: Any = None) -> Iterator[Optional[tf.train.ClusterSpec]]:
    """Connect as ``--cluster_workers``/``--cluster``/TF_CONFIG say; yield the ClusterSpec.

    Yields None (nothing connected) when none of them is given. Local workers
    started for ``--cluster_workers`` stop when the block ends.
    """
    from absl import flags

    fv = flags.FLAGS if flag_values is None else flag_values  # an empty FlagValues is falsy
    if fv.cluster_workers:
        with LocalCluster(fv.cluster_workers) as local:
            yield connect(local)
    elif fv.cluster or os.environ.get("TF_CONFIG"):
        yield connect(fv.cluster)
    else:
        yield None


# ---------------------------------------------------------------------------- worker process
def _exit_when_orphaned(parent_pid: int, lifetime: Optional[float]) -> None:
    end = None if not lifetime else time.monotonic() + lifetime
    while True:
        if parent_pid and os.getppid() != parent_pid:
            os._exit(0)  # the launcher is gone: nobody will stop us
        if end is not None and time.monotonic() > end:
            os._exit(0)
        time.sleep(0.5)


def serve(
    cluster: ClusterLike,
    job_name: str = "worker",
    task_index: int = 0,
    protocol: str = "grpc",
    virtual_cpus: int = 1,
    threads: int = 0,
) -> tf.distribute.Server:
    """Start this process's ``tf.distribute.Server`` for task ``task_index`` of ``job_name``."""
    config = tf.compat.v1.ConfigProto(
        device_count={"CPU": virtual_cpus},
        intra_op_parallelism_threads=threads,
        inter_op_parallelism_threads=threads,
    )
    return tf.distribute.Server(
        cluster_spec(cluster),
        job_name=job_name,
        task_index=task_index,
        protocol=protocol,
        config=config,
        start=True,
    )


def _worker_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tf_gpipe.cluster",
        description="Run one TensorFlow worker server that can hold tf_gpipe stages.",
    )
    parser.add_argument("--worker", action="store_true", required=True, help="run a worker server")
    parser.add_argument("--cluster", default=None, help="cluster JSON or host:port,... (default: TF_CONFIG)")
    parser.add_argument("--job_name", default=None, help="default: TF_CONFIG task type, else 'worker'")
    parser.add_argument("--task_index", type=int, default=None, help="default: TF_CONFIG task index")
    parser.add_argument("--protocol", default="grpc")
    parser.add_argument("--virtual_cpus", type=int, default=1, help="logical CPU devices to expose")
    parser.add_argument("--threads", type=int, default=0, help="intra/inter-op threads (0: default)")
    parser.add_argument("--parent_pid", type=int, default=0, help="exit when this parent process is gone")
    parser.add_argument("--lifetime", type=float, default=0, help="exit after this many seconds (0: never)")
    args = parser.parse_args(argv)
    _, task = _parse(args.cluster)
    job = args.job_name or (task or {}).get("type") or "worker"
    index = args.task_index if args.task_index is not None else int((task or {}).get("index", 0))
    server = serve(args.cluster, job, index, args.protocol, args.virtual_cpus, args.threads)
    threading.Thread(target=_exit_when_orphaned, args=(args.parent_pid, args.lifetime), daemon=True).start()
    print(f"{_READY} /job:{job}/replica:0/task:{index} {server.target} pid={os.getpid()}", flush=True)
    server.join()
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
