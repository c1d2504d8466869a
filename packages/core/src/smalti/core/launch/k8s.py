"""Kubernetes: a Kubeflow ``PyTorchJob`` (training-operator, ``kubeflow.org/v1``) that runs ``smalti-train`` under torchrun.

Why PyTorchJob rather than JobSet: the training-operator already speaks torchrun's elastic protocol
(``elasticPolicy`` -> ``PET_*`` variables that torchrun reads, a Service per worker pod so ``<job>-worker-0``
resolves as the c10d rendezvous host), restarts pods by exit code, and is what clusters running Kubeflow have
installed. JobSet is a lower-level building block (Kubeflow Trainer v2 builds on it) where the rendezvous
host, ports and restart rules would all have to be spelled out by hand.

What the manifest holds:

- one ``Worker`` replica per node, each running ``python -m torch.distributed.run --nnodes=... --rdzv-backend=c10d
  --rdzv-endpoint=<job>-worker-0:<port> --rdzv-id=<job> --max-restarts=N -m smalti.core.cli.train <overrides>``;
- ``elasticPolicy`` with the same rendezvous, so the operator's own variables agree with the command line;
- ``restartPolicy: ExitCode``: torchrun restarts failed ranks inside the pods (``--max-restarts``); the operator
  re-creates pods killed by a signal or evicted (exit >= 128), and a permanent error (1-127, such as the preflight
  refusing a bad node) fails the job instead of looping; ``runPolicy.backoffLimit`` caps re-creations;
- the cordon list as node anti-affinity (``kubernetes.io/hostname NotIn [...]``), one pod per node
  (pod anti-affinity), and an init container running ``smalti-launch preflight`` on each node before it joins.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from smalti.core.launch.cordon import CordonedHost
from smalti.core.launch.errors import LaunchError
from smalti.core.launch.script_values import (
    IMAGE_REFERENCE,
    check_all_no_control,
    check_env,
    check_host_name,
    check_no_control,
    check_pattern,
)
from smalti.core.launch.torchrun import TorchrunSettings, train_command

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
#: The training-operator injects its variables into the container with this name.
CONTAINER_NAME = "pytorch"
HOSTNAME_LABEL = "kubernetes.io/hostname"
RUN_LABEL = "smalti.dev/run"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(kw_only=True)
class PyTorchJobOptions:
    """What ``smalti-launch k8s`` puts in the manifest."""

    name: str
    nodes: int
    gpus_per_node: int = 0
    nproc_per_node: int | None = None
    min_nodes: int | None = None
    image: str = "smalti:latest"
    namespace: str | None = None
    max_restarts: int = 3
    backoff_limit: int = 3
    rdzv_port: int = 29400
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cordoned: list[CordonedHost] = field(default_factory=list)
    preflight: bool = True
    pvc: str | None = None
    mount_path: str = "/workspace"

    def validate(self) -> None:
        """Fail, naming the option, on values the API server or torchrun would reject later."""
        if len(self.name) > 50 or not _DNS_LABEL.match(self.name):
            raise LaunchError(
                f"--name {self.name!r} is not a valid job name: lower-case letters, digits and '-', starting with a "
                "letter, at most 50 characters (pod names add '-worker-N')"
            )
        if self.nodes < 1:
            raise LaunchError(f"--nodes must be at least 1, got {self.nodes}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise LaunchError(f"--min-nodes must be between 1 and --nodes ({self.nodes}), got {self.min_nodes}")
        if self.gpus_per_node < 0 or (self.nproc_per_node is not None and self.nproc_per_node < 1):
            raise LaunchError("--gpus-per-node must be >= 0 and --nproc-per-node >= 1")
        if self.max_restarts < 0 or self.backoff_limit < 0:
            raise LaunchError("--max-restarts and --backoff-limit must be >= 0")
        check_pattern(self.image, IMAGE_REFERENCE, "--image", "an image reference ([registry/]path[:tag][@digest])")
        for flag, value in (("--namespace", self.namespace), ("--pvc", self.pvc)):
            if value is not None and (len(value) > 63 or not _DNS_LABEL.match(value)):
                raise LaunchError(f"{flag} {value!r} is not a valid name: lower-case letters, digits and '-'")
        check_no_control(self.mount_path, "--mount-path")
        check_env(self.env, "--env")
        check_all_no_control(self.overrides, "overrides")
        for i, cordoned in enumerate(self.cordoned):
            check_host_name(cordoned.host, f"cordoned host {i}")

    @property
    def procs_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1

    def torchrun_command(self) -> list[str]:
        """The container's command: torchrun's agent, then every rank runs the Hydra app with the overrides."""
        settings = TorchrunSettings(max_restarts=self.max_restarts, min_nodes=self.min_nodes)
        args = settings.args(
            nnodes=self.nodes,
            nproc_per_node=self.procs_per_node,
            endpoint=f"{self.name}-worker-0:{self.rdzv_port}",
            rdzv_id=self.name,
        )
        return ["python", "-m", "torch.distributed.run", *args, *train_command(self.overrides)]


def build_pytorchjob(opts: PyTorchJobOptions) -> dict[str, Any]:
    """The PyTorchJob manifest as a dict (see the module docstring for what it holds)."""
    opts.validate()
    metadata: dict[str, Any] = {"name": opts.name, "labels": {RUN_LABEL: opts.name}}
    if opts.namespace:
        metadata["namespace"] = opts.namespace
    if opts.cordoned:
        metadata["annotations"] = {
            "smalti.dev/cordoned": "; ".join(f"{c.host}: {c.reason}" if c.reason else c.host for c in opts.cordoned)
        }
    env = [
        {"name": "SMALTI_RUN_NAME", "value": opts.name},
        {"name": "SMALTI_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # restarted ranks get a fresh rendezvous store per round (pytorch/pytorch#135712)
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
        *({"name": k, "value": v} for k, v in opts.env.items()),
    ]
    resources = {"limits": {"nvidia.com/gpu": opts.gpus_per_node}} if opts.gpus_per_node else {}
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if opts.pvc:
        mounts.append({"name": "shared", "mountPath": opts.mount_path})
        volumes.append({"name": "shared", "persistentVolumeClaim": {"claimName": opts.pvc}})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": opts.image,
        "command": opts.torchrun_command(),
        "env": env,
        "ports": [{"name": "c10d", "containerPort": opts.rdzv_port}],
        "volumeMounts": mounts,
    }
    if opts.pvc:
        container["workingDir"] = opts.mount_path  # outputs/<run>/ and rank logs land on the shared volume
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {"affinity": _affinity(opts), "containers": [container], "volumes": volumes}
    if opts.preflight:
        preflight: dict[str, Any] = {
            "name": "preflight",
            "image": opts.image,
            "command": ["smalti-launch", "preflight"],
            "env": env[:2],
        }
        if resources:
            preflight["resources"] = resources
        pod_spec["initContainers"] = [preflight]
    elastic: dict[str, Any] = {
        "rdzvBackend": "c10d",
        "rdzvPort": opts.rdzv_port,
        "minReplicas": opts.min_nodes or opts.nodes,
        "maxReplicas": opts.nodes,
        "maxRestarts": opts.max_restarts,
    }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "nprocPerNode": str(opts.procs_per_node),
            "elasticPolicy": elastic,
            "runPolicy": {"backoffLimit": opts.backoff_limit, "cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": opts.nodes,
                    "restartPolicy": "ExitCode",
                    "template": {"metadata": {"labels": {RUN_LABEL: opts.name}}, "spec": pod_spec},
                }
            },
        },
    }


def _affinity(opts: PyTorchJobOptions) -> dict[str, Any]:
    affinity: dict[str, Any] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {RUN_LABEL: opts.name}}, "topologyKey": HOSTNAME_LABEL}
            ]
        }
    }
    if opts.cordoned:
        affinity["nodeAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [
                        {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": [c.host for c in opts.cordoned]}
                    ]}
                ]
            }
        }
    return affinity


def to_yaml(manifest: dict[str, Any]) -> str:
    """The manifest as YAML, with a header naming its generator and operator."""
    header = f"# Generated by smalti-launch k8s: a Kubeflow training-operator {KIND} ({API_VERSION}).\n"
    return header + yaml.safe_dump(manifest, sort_keys=False, default_flow_style=False)


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings to a dict; a pair without ``=`` fails naming it."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise LaunchError(f"--env {pair!r} is not KEY=VALUE")
        out[key] = value
    return out


def default_job_name() -> str:
    """``$SMALTI_RUN_NAME`` lower-cased into a valid job name, else ``smalti-run``."""
    name = re.sub(r"[^a-z0-9-]+", "-", os.environ.get("SMALTI_RUN_NAME", "smalti-run").lower()).strip("-")
    return name or "smalti-run"
