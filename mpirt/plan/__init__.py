"""mpirt's performance model and planner (``python -m mpirt.plan``; docs/planner.md).

- :mod:`~mpirt.plan.hardware`: :class:`Cluster` and the presets (A100, H100, H200, CPU, calibrated);
- :mod:`~mpirt.plan.work`: what a micro-batch asks of a rank, layer by layer and pass by pass;
- :mod:`~mpirt.plan.model`: :func:`estimate`, one step of a layout predicted part by part;
- :mod:`~mpirt.plan.search`: the planner (every feasible layout, ranked);
- :mod:`~mpirt.plan.calibrate`: ``--calibrate`` (this machine's GEMM, bandwidth, MPI at N ranks);
- :mod:`~mpirt.plan.selfcheck`: :func:`self_check`, predicted against measured after a run.
"""
from mpirt.plan.hardware import PRESETS, Cluster, load
from mpirt.plan.model import Estimate, coll_time, estimate
from mpirt.plan.search import plan
from mpirt.plan.selfcheck import format_lines, self_check, this_machine

__all__ = ["PRESETS", "Cluster", "Estimate", "coll_time", "estimate", "format_lines", "load", "plan", "self_check",
           "this_machine"]
