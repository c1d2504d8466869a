"""``smalti-launch preflight``: run smalti-health's node checks before this node joins a job.

The checks, the cordon list and the "do not restart on this node" exit code belong to smalti-health
(``smalti-health preflight``); this delegates to it, passing its exit code through unchanged, so a launcher
(torchrun wrapper script, Slurm task, Kubernetes init container) can act on it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points

log = logging.getLogger(__name__)

HEALTH_SCRIPT = "smalti-health"
#: Exit code of ``smalti-launch preflight --require`` when smalti-health is not installed.
MISSING_HEALTH_EXIT = 3


def health_entry_point() -> EntryPoint | None:
    """smalti-health's console-script entry point, when the package is installed."""
    found = entry_points(group="console_scripts", name=HEALTH_SCRIPT)
    return next(iter(found), None)


def run_preflight(args: Sequence[str], require: bool = False) -> int:
    """Run ``smalti-health preflight ARGS`` in a child process; return its exit code.

    Without smalti-health: say so and return 0 (or :data:`MISSING_HEALTH_EXIT` when ``require``).
    """
    ep = health_entry_point()
    if ep is None:
        msg = f"{HEALTH_SCRIPT} is not installed: no preflight checks ran on this node (pip install smalti-health)"
        if require:
            print(f"smalti-launch preflight: {msg}", file=sys.stderr)
            return MISSING_HEALTH_EXIT
        print(f"smalti-launch preflight: {msg}; continuing", file=sys.stderr)
        log.warning(msg)
        return 0
    module, _, attr = ep.value.partition(":")
    # The entry point's own function, run as its console script would be, by this interpreter (PATH may lack it).
    bootstrap = (
        f"import sys, importlib; sys.argv[0] = {HEALTH_SCRIPT!r}; "
        f"f = importlib.import_module({module!r})\n"
        f"for part in {attr!r}.split('.'): f = getattr(f, part)\n"
        "sys.exit(f())"
    )
    return subprocess.run([sys.executable, "-c", bootstrap, "preflight", *args], check=False).returncode
