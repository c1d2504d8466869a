"""Scale-out: run the same ``smalti-train`` config under torchrun, Slurm (Hydra's submitit launcher) or Kubernetes.

smalti does not bring its own cluster manager. Each engine starts torchrun's elastic agent on every node, and the
agent starts the ranks:

- ``torchrun ... -m smalti.core.cli.train <overrides>`` directly (one machine or many);
- ``smalti-train -m hydra/launcher=submitit_slurm ...``: one submitit task per node whose Hydra task function
  starts the agent (:mod:`smalti.core.launch.node`, :mod:`smalti.core.launch.submitit`);
- ``smalti-launch k8s ...``: a Kubeflow ``PyTorchJob`` manifest (:mod:`smalti.core.launch.k8s`).

``smalti-launch logs RUN`` merges and follows the per-rank log files; ``smalti-launch preflight`` runs
smalti-health's node checks when that package is installed.
"""

from smalti.core.launch.errors import LaunchError

__all__ = ["LaunchError"]
