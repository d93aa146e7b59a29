"""Test-only: real parallel bugs switched on by name, to prove that ``python -m mpirt.verify``
catches them (tests/test_verify.py). Never set this in a real run.

``MPIRT_VERIFY_INJECT=NAME[,NAME...]`` (read here and nowhere else, at every check, so a test may
change it between runs in one process) turns on, in the runtime code that owns each:

- ``tp-row-scale``: the backward of a row-parallel layer's output reduction (Megatron's ``g``,
  :class:`mpirt.parallel.tensor.mappings.ReduceFromTP`) returns ``tp * dy``: the replicated gradient
  summed over tp without its ``1/tp`` (tp > 1 only);
- ``sp-dropped-reduce-scatter``: under sequence parallelism a row-parallel layer keeps its own chunk
  of its partial sum instead of reduce-scattering the partial sums
  (:class:`mpirt.parallel.tensor.mappings.ReduceScatterToSeq`, tp > 1 only);
- ``cp-ring-step``: ring attention computes each ring step's keys and values as if they were the
  next step's (the causal mask and chunk pairing of the wrong step, :mod:`mpirt.parallel.context`);
- ``cp-ring-extra-pass``: ring attention passes the keys and values on once more than it needs
  (cp passes, the last one unused): the numbers stay right, the communication does not
  (:mod:`mpirt.parallel.context`; caught by the recorded-communication check, :mod:`mpirt.verify.traffic`);
- ``zero-shard-offset``: ZeRO-1/2's first dp rank updates the parameter elements one place after its
  shard (:class:`mpirt.parallel.zero.ZeroOptimizer`, dp > 1 only);
- ``pp-microbatch-order``: the last pipeline stage pairs each micro-batch's activations with the
  targets of the micro-batches in reverse order (:class:`mpirt.parallel.pipeline.stage.PipelineStage`);
- ``ep-expert-swap``: under ep a rank runs the rows routed to its first expert through its second
  expert's weights and the other way round (:class:`mpirt.parallel.experts.ExpertParallel`).
- ``scalar-dtype-from-value``: the bug of the wrong gradient norm under pp x dp x ZeRO, put back: a
  ZeRO shard that holds nothing counted sums its squares to the integer 0
  (:func:`mpirt.parallel.flat.sum_squares`), and :meth:`mpirt.comm.Comm.allreduce_scalar` reduces a
  number in its own dtype, so that rank sends int64 where its peers send float64 (caught by the
  recorded-communication check's dtypes, :mod:`mpirt.verify.traffic`).

Each is a no-op where its axis has one rank, so a single-rank reference stays correct. One more
is not a bug but a routing no trained router is known to reach, for the memory tests
(tests/test_memory.py): ``moe-router-bias``: a mixture of experts' router makes expert 0 every
token's first choice (models/moe.py), the most one expert can be loaded.
"""
from __future__ import annotations

import os

ENV = "MPIRT_VERIFY_INJECT"
BUGS = ("tp-row-scale", "sp-dropped-reduce-scatter", "cp-ring-step", "cp-ring-extra-pass", "zero-shard-offset",
        "pp-microbatch-order", "ep-expert-swap", "scalar-dtype-from-value", "moe-router-bias")


def injected(name: str) -> bool:
    """Whether the test-only bug ``name`` (one of :data:`BUGS`) is switched on in this process."""
    assert name in BUGS, name
    value = os.environ.get(ENV)
    return bool(value) and name in value.split(",")


def check_environment() -> None:
    """Refuse (ValueError naming the variable) a :data:`ENV` that names an unknown bug: a typo
    would otherwise leave every bug off and a test of the hook pass for the wrong reason."""
    unknown = [n for n in (os.environ.get(ENV) or "").split(",") if n and n not in BUGS]
    if unknown:
        raise ValueError(f"{ENV}: unknown bug {unknown[0]!r} (known: {', '.join(BUGS)})")
