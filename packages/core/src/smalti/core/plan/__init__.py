"""``smalti plan``: per-GPU memory, a roofline step time and MFU for a run config, before a cluster is booked.

:mod:`.report` composes the run and prints the plan, :mod:`.estimate` holds the formulas, :mod:`.hardware`
the accelerators and assumptions, :mod:`.types` what the ``smalti_plan_model`` hook exchanges.
"""

from smalti.core.plan.types import ModelEstimate, PlanSetup

__all__ = ["ModelEstimate", "PlanSetup"]
