"""Resolve the device each pipeline stage runs on, and make logical CPU devices for demos."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import tensorflow as tf

__all__ = ["configure_virtual_cpus", "exact_float32"]


def configure_virtual_cpus(n: int) -> list[str]:
    """Split the host CPU into ``n`` logical CPU devices and return their names.

    Must run before TensorFlow initializes its devices (before the first op).
    Logical CPUs share one thread pool: they show placement and overlap, not
    extra compute. Calling it again with the same ``n`` is harmless.
    """
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as e:
        have = tf.config.list_logical_devices("CPU")
        if len(have) < n:
            raise RuntimeError(
                f"tf_gpipe: cannot make {n} logical CPUs: TensorFlow is already initialized "
                f"with {len(have)}. Call tf_gpipe.configure_virtual_cpus({n}) at the top of "
                "your program, before any TensorFlow op runs."
            ) from e
    return [d.name for d in tf.config.list_logical_devices("CPU")[:n]]


def _available() -> list[str]:
    return [d.name for d in tf.config.list_logical_devices()]


def default_devices(num_stages: int) -> list[str]:
    """Visible GPUs, else logical CPUs, else CPU:0; assigned to stages round-robin.

    With fewer devices than stages, stage ``k`` goes to device ``k % num_devices``:
    stages that share a device run one after another there (re-materialization still
    saves memory, pipelining saves no time), and a warning says so. Logical CPUs are
    never mixed in with GPUs: a CPU stage would be far slower than its GPU neighbours.
    """
    pool = [d.name for d in tf.config.list_logical_devices("GPU")]
    if pool and len(pool) < num_stages:
        more = "split a GPU into logical GPUs with tf.config.set_logical_device_configuration"
        _warn_shared(num_stages, len(pool), "GPU", f"{more} before TensorFlow starts")
    if not pool:
        pool = [d.name for d in tf.config.list_logical_devices("CPU")] or ["/device:CPU:0"]
        if len(pool) < num_stages:
            more = f"make logical CPUs with tf_gpipe.configure_virtual_cpus({num_stages})"
            _warn_shared(num_stages, len(pool), "CPU", f"{more} before TensorFlow starts")
    return [pool[k % len(pool)] for k in range(num_stages)]


def _warn_shared(num_stages: int, have: int, kind: str, more: str) -> None:
    warnings.warn(
        f"tf_gpipe: {num_stages} stages on {have} {kind}(s): stage k runs on {kind} k % "
        f"{have}, so stages share a {kind} and run one after another there. Pass "
        f"devices=[...] to choose, or {more}.",
        stacklevel=4,  # resolve_devices' caller
    )


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """Run float32 matmuls and convolutions in full float32 inside the block.

    Recent NVIDIA GPUs use TF32 (10-bit mantissa) for float32 matmuls by default,
    and pick kernels by shape: a micro-batched and an unsplit model then differ by
    ~1e-3 relative although they compute the same function. Comparisons between
    the two belong in this block; elsewhere TF32 is TensorFlow's (fast) default.

    An XLA program keeps the precision it was compiled with: a pipeline's XLA stages
    have separate programs inside the block, but a step function Keras traced before
    it (``model.predict_function`` and the like) keeps calling the programs it traced.
    Compare with ``predict`` or ``evaluate`` first run inside the block, or reset the
    model's ``predict_function`` (etc.) to None before it.
    """
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)


def _canonical(name: str) -> tf.DeviceSpec:
    text = name.strip()
    if not text.startswith("/"):
        text = "/device:" + text
    spec = tf.DeviceSpec.from_string(text)
    if spec.device_type is not None:
        spec = spec.replace(device_type=spec.device_type.upper())
    return spec


def _matches(spec: tf.DeviceSpec, full: tf.DeviceSpec) -> bool:
    for field in ("job", "replica", "task", "device_type", "device_index"):
        want = getattr(spec, field)
        if want is not None and want != getattr(full, field):
            return False
    return True


def resolve_devices(devices: Sequence[str] | None, num_stages: int) -> list[str]:
    """Check user device strings against TensorFlow's devices; one per stage.

    Accepts the forms TensorFlow accepts ("GPU:1", "/gpu:1", "/device:CPU:0",
    "/job:worker/task:1/device:CPU:0"). Returns them in canonical form.
    """
    if devices is None:
        return default_devices(num_stages)
    if isinstance(devices, str):
        raise TypeError(
            f"tf_gpipe: devices must be a list with one device per stage, got the string "
            f"{devices!r}; pass [{devices!r}, ...]."
        )
    devices = list(devices)
    if len(devices) != num_stages:
        raise ValueError(
            f"tf_gpipe: got {len(devices)} devices for {num_stages} stages; pass exactly one "
            f"device per stage (devices=None picks {default_devices(num_stages)})."
        )
    available = _available()
    full_specs = [tf.DeviceSpec.from_string(a) for a in available]
    out = []
    for d in devices:
        if not isinstance(d, str):
            raise TypeError(f"tf_gpipe: device {d!r} is not a string like '/device:GPU:0'.")
        try:
            spec = _canonical(d)
        except ValueError as e:
            raise ValueError(f"tf_gpipe: cannot parse device {d!r}: {e}") from e
        hits = [a for a, f in zip(available, full_specs) if _matches(spec, f)]
        if spec.device_type is None or not hits:
            raise ValueError(
                f"tf_gpipe: unknown device {d!r}. Available devices: {available}. "
                "On a CPU-only machine, call tf_gpipe.configure_virtual_cpus(n) first to get n "
                "logical CPUs; for remote workers, connect first with "
                "tf_gpipe.cluster.connect(...) (tf.config.experimental_connect_to_cluster)."
            )
        out.append(spec.to_string())
    return out
