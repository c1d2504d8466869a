"""``smalti-health preflight``: the checks a node runs before it joins a job, and the verdict as an exit code.

A node refuses to join (exit :data:`DO_NOT_RESTART_EXIT`, the code NVIDIA's resiliency extension also uses
for "do not requeue") when its host is on the cordon list or a check fails; with ``--add-to-cordon`` a
failing node also puts itself on the list so later launches avoid it. On a CPU-only machine the GPU check
reports "no GPU" and passes unless ``--require-gpu``. smalti-core's ``smalti-launch preflight`` runs this
and passes the exit code through.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from smalti.health.cordon import add_to_cordon, is_cordoned
from smalti.health.gpu import check_gpus
from smalti.health.results import CheckResult, Verdict, worst

#: Exit code: this node must not run the job (cordoned or failed a check); do not restart it here.
DO_NOT_RESTART_EXIT = 93


def this_host() -> str:
    """The node's name: ``SMALTI_NODE_NAME`` (set by smalti-launch's manifests) or the host name."""
    return os.environ.get("SMALTI_NODE_NAME") or socket.gethostname()


@dataclass
class PreflightOutcome:
    """What preflight found: every result, the overall verdict and the exit code to return."""

    host: str
    results: list[CheckResult] = field(default_factory=list)
    exit_code: int = 0

    @property
    def verdict(self) -> Verdict:
        return worst(*(r.verdict for r in self.results))


def run_preflight(
    cordon: str | None = None,
    host: str | None = None,
    require_gpu: bool = False,
    add_to_cordon_on_fail: bool = False,
    fail_on_warn: bool = False,
    compute_seconds: float = 0.0,
    min_fraction_of_peak: float | None = None,
    call_deadline_s: float = 5.0,
    nvml: object | None = None,
) -> PreflightOutcome:
    """Run the node checks; see the module docstring for what makes the node refuse."""
    host = host or this_host()
    outcome = PreflightOutcome(host)
    if cordon:
        reason = is_cordoned(cordon, host)
        if reason is not None:
            outcome.results.append(CheckResult("cordon", Verdict.FAIL, f"host {host} is cordoned in {cordon}: {reason}"))
            outcome.exit_code = DO_NOT_RESTART_EXIT
            return outcome
        outcome.results.append(CheckResult("cordon", Verdict.OK, f"host {host} is not cordoned in {cordon}"))
    gpus = check_gpus(nvml, call_deadline_s)
    if require_gpu and "health/gpu/count" in gpus[0].metrics:
        gpus[0].verdict = Verdict.FAIL
        gpus[0].message += " (--require-gpu)"
    outcome.results.extend(gpus)
    if compute_seconds > 0:
        from smalti.health.compute import run_compute_check

        outcome.results.append(run_compute_check(seconds=compute_seconds, min_fraction_of_peak=min_fraction_of_peak))
    bad = {Verdict.FAIL, Verdict.WARN} if fail_on_warn else {Verdict.FAIL}
    failed = [r for r in outcome.results if r.verdict in bad]
    if failed:
        outcome.exit_code = DO_NOT_RESTART_EXIT
        if cordon and add_to_cordon_on_fail:
            add_to_cordon(cordon, host, "preflight: " + "; ".join(r.message for r in failed))
    return outcome
