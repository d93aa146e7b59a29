"""``python -m mpirt.verify``: hold a parallel layout to the single rank (or a smaller layout) on the
user's own model and flags, and replay a checkpoint's next step at another layout.

- :mod:`mpirt.verify.cli`: the command, its plan and its report;
- :mod:`mpirt.verify.sides`: a layout built and stepped like training, its weights snapshotted;
- :mod:`mpirt.verify.compare`: step by step, tensor by tensor, the verdict.
"""
