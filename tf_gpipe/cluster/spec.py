"""Cluster descriptions: TF_CONFIG, JSON, ``host:port`` lists, dicts, ClusterSpecs, LocalClusters."""

from __future__ import annotations

import json
import os
from typing import Union

import tensorflow as tf

from tf_gpipe.cluster.local import LocalCluster

__all__ = ["ClusterLike", "cluster_spec"]

ClusterLike = Union[None, str, dict, tf.train.ClusterSpec, "LocalCluster"]


def parse_cluster(cluster: ClusterLike) -> tuple:
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
    return parse_cluster(cluster)[0]


def job_addresses(spec: tf.train.ClusterSpec, job: str) -> dict[int, str]:
    if job not in spec.jobs:
        raise ValueError(
            f"tf_gpipe: the cluster has no job {job!r}; its jobs are {spec.jobs}. "
            f"Name the workers' job with job_name=..."
        )
    return {i: spec.task_address(job, i) for i in spec.task_indices(job)}
