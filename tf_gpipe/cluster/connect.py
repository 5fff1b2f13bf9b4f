"""Join a TensorFlow cluster, and name the devices that hold the stages."""

from __future__ import annotations

import ipaddress
import socket
import time

import tensorflow as tf

from tf_gpipe import tf_compat
from tf_gpipe.cluster.spec import ClusterLike, cluster_spec, job_addresses, parse_cluster
from tf_gpipe.cluster.watch import WorkerFailedError, probe_address

__all__ = ["client_device", "connect", "worker_devices"]

_CLIENT_JOB = "client"


def _wait_answering(addresses: dict[int, str], job: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    missing = dict(addresses)
    while missing:
        left = max(0.5, min(5.0, deadline - time.monotonic()))
        missing = {i: a for i, a in missing.items() if probe_address(a, left) is not None}
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


def _host(address: str) -> str:
    """The host part of ``host:port``, ``[v6]:port`` or a bare host."""
    address = address.strip()
    if address.startswith("["):
        return address[1 : address.index("]")] if "]" in address else address[1:]
    if address.count(":") == 1:
        return address.rsplit(":", 1)[0]
    return address  # a bare host name, IPv4 or IPv6 address


def _is_loopback(host: str) -> bool:
    """Only this machine can reach it. Read from the text alone: no name is resolved."""
    host = host.strip().lower()
    if host in ("localhost", "") or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def _on_this_host(host: str) -> bool:
    return _is_loopback(host) or host.strip().lower() == socket.gethostname().lower()


def _with_port(address: str) -> str:
    """``address`` as ``host:port``: a bare host gets a port that is free here."""
    host = _host(address)
    if address.strip() != host and not address.strip().endswith("]"):
        return address.strip()
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _client_spec(
    spec: tf.train.ClusterSpec, task: dict | None, job_name: str, address: str | None
) -> tuple[tf.train.ClusterSpec, str, int]:
    """The ClusterSpec to connect with (the client's own task included), its job and index.

    Checked before any connection: a worker on another host reaches the client at the
    address this spec gives it, so a loopback one there would make it dial itself.
    """
    workers = job_addresses(spec, job_name)
    client_job, client_index = _CLIENT_JOB, 0
    if task and task.get("type") == job_name:
        raise ValueError(
            f"tf_gpipe: TF_CONFIG says this process is {job_name} task {task.get('index', 0)}; "
            "a worker serves devices (python -m tf_gpipe.cluster --worker), the training "
            "script runs as another task (e.g. 'chief') or with no task at all."
        )
    if task and task.get("type") is not None:
        client_job, client_index = task["type"], int(task.get("index", 0))
    jobs = spec.as_dict()
    named = None
    if client_job in jobs:
        try:
            named = spec.task_address(client_job, client_index)
        except ValueError as e:
            raise ValueError(
                f"tf_gpipe: TF_CONFIG names this process {client_job} task {client_index}, but the "
                f"cluster lists no address for it ({e}). Add it to the {client_job!r} job of "
                "TF_CONFIG['cluster']."
            ) from None
    if address is not None:
        if named is not None and named != address:
            raise ValueError(
                f"tf_gpipe: connect(address={address!r}) but the cluster gives this process "
                f"({client_job} task {client_index}) the address {named!r}. Give one of them."
            )
        if named is None:
            if client_job in jobs:
                raise ValueError(
                    f"tf_gpipe: the cluster already has a job {client_job!r} without task "
                    f"{client_index}; name this process's task in TF_CONFIG['task'] instead."
                )
            named = _with_port(address)
            jobs = dict(jobs, **{client_job: [named]})
            spec = tf.train.ClusterSpec(jobs)
    remote = {i: a for i, a in workers.items() if not _on_this_host(_host(a))}
    client_host = "localhost" if named is None else _host(named)
    if remote and _is_loopback(client_host):
        i, a = next(iter(remote.items()))
        given = "no address" if named is None else f"the address {named!r}"
        raise ValueError(
            f"tf_gpipe: this process would join the cluster with {given} on loopback "
            f"({client_host}), but /job:{job_name}/replica:0/task:{i} is on another host ({a}) "
            "and would dial itself to reach it. Give this process an address the workers can "
            "reach: a 'chief' task in TF_CONFIG (cluster {'chief': ['thishost:2223'], "
            "'worker': [...]}, task {'type': 'chief', 'index': 0}), or "
            "connect(..., address='thishost:2223') (or address='thishost' for a free port)."
        )
    return spec, client_job, client_index


def connect(
    cluster: ClusterLike = None,
    job_name: str = "worker",
    protocol: str = "grpc",
    *,
    timeout: float = 60.0,
    address: str | None = None,
) -> tf.train.ClusterSpec:
    """Connect this process to a TensorFlow cluster so its devices can hold stages.

    Waits (at most ``timeout`` seconds) until the TensorFlow server of every task of
    job ``job_name`` answers, then calls ``tf.config.experimental_connect_to_cluster``.
    This process joins as the task that ``TF_CONFIG["task"]`` names when that is not
    a ``job_name`` task (its address from the cluster), else as job ``"client"`` at
    ``address``, else as job ``"client"`` on ``localhost`` with a free port (TensorFlow's
    choice), which only workers on this machine can reach: with a worker on another
    host, a loopback address for this process is refused before anything is sent.
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
        address: ``"host:port"`` (or ``"host"``: a free port) where the workers reach
            this process, when the cluster does not list it; its server listens on
            that port on every interface.

    Returns:
        The ``tf.train.ClusterSpec`` this process connected with: the cluster's, plus
        job ``"client"`` when ``address`` added it.
    """
    spec, task = parse_cluster(cluster)
    spec, client_job, client_index = _client_spec(spec, task, job_name, address)
    _wait_answering(job_addresses(spec, job_name), job_name, timeout)
    tf.config.experimental_connect_to_cluster(
        spec, job_name=client_job, task_index=client_index, protocol=protocol
    )
    return spec


def client_device() -> str:
    """This process's own CPU after ``connect``: where to read data and write checkpoints.

    Pass it as ``tf.train.CheckpointOptions(experimental_io_device=client_device())`` so a
    checkpoint of variables on remote workers is written by this process, to its own disk.
    """
    server_def = tf_compat.server_def()
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
        tasks = len(job_addresses(cluster_spec(cluster), job))
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
