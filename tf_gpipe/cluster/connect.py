"""Join a TensorFlow cluster, and name the devices that hold the stages."""

from __future__ import annotations

import time

import tensorflow as tf
from tensorflow.python.eager import context as _context

from tf_gpipe.cluster.spec import ClusterLike, _addresses, _parse, cluster_spec
from tf_gpipe.cluster.watch import WorkerFailedError, _probe

__all__ = ["client_device", "connect", "worker_devices"]

_CLIENT_JOB = "client"


def _wait_answering(addresses: dict[int, str], job: str, timeout: float) -> None:
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
) -> list[str]:
    """``num`` device strings on the tasks of ``job``, one per stage, task-major round-robin.

    With a connected cluster: device 0 of task 0, device 0 of task 1, ..., then
    device 1 of each task, and so on. Before ``connect`` (or with ``cluster`` given),
    stage ``k`` gets ``/job:{job}/replica:0/task:{k % tasks}/device:{device_type}:0``.
    """
    device_type = device_type.upper()
    tasks: int | None = None
    if cluster is not None:
        tasks = len(_addresses(cluster_spec(cluster), job))
    found: dict[int, list[tf.DeviceSpec]] = {}
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
