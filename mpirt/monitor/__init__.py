"""Watching a run: the run's monitor, metrics and progress (live), per-step breakdown (steps), peak
FLOP/s and MFU (flops), the Chrome trace (trace), GPU sampling (gpu) and the report (report)."""
