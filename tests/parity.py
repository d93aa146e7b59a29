"""The parity harness shared by the tests that hold a parallel run to the single-rank run: the tiny
GPT, its deterministic batches, the single-rank AdamW reference, relative errors and tolerances.

Every rank computes the reference itself on the whole global batch (no communication); the tests
compare their own share and reduce the verdict over the ranks (:func:`conftest.agree`, :func:`worst`).
"""
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from mpirt.comm import Comm
from mpirt.data.tokens import get_batch
from mpirt.models import GPT, GPTConfig
from mpirt.core.optim import AdamW, clip_grad_norm
from mpirt.core.tensor import no_grad
from mpirt.verify.compare import comparable

SEQ, STEPS, LR, WD = 8, 5, 1e-3, 0.1
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, n_positions=SEQ, vocab_size=37)
TOL = {"float64": 1e-10, "float32": 1e-5}
# Weights after AdamW steps: AdamW divides each gradient element by its own running RMS, so float32
# noise in near-zero gradient elements moves those elements by ~lr (see max_rel_err). With
# numpy 2.4.6's OpenBLAS (0.3.31) the DP and ZeRO runs measured 1.4e-5 to 1.65e-5 against one rank
# (gradients 4e-7), MKL and BLIS under 1e-5; float64 holds the algorithm itself to 1e-10.
WEIGHTS_TOL = {"float64": 1e-10, "float32": 5e-5}


def within(errs: dict, dtype: str) -> bool:
    """Every error under its tolerance: ``"weights"`` under :data:`WEIGHTS_TOL`, the rest under :data:`TOL`."""
    return all(e <= (WEIGHTS_TOL if k == "weights" else TOL)[dtype] for k, e in errs.items())


# --- models and batches ------------------------------------------------------------------------
def make_model(dtype, cfg=CFG, seed=1):
    """The test GPT (``cfg``, default :data:`CFG`) with its seeded initial weights."""
    return GPT(cfg, dtype=dtype, seed=seed)


@lru_cache
def tokens(seed: int = 0) -> np.ndarray:
    """4096 uniform tokens below :data:`CFG`'s vocabulary, drawn with ``seed``."""
    return np.random.default_rng(seed).integers(0, 37, 4096).astype(np.uint16)


TOKENS = tokens(0)


def global_rows(size: int, accum: int = 1) -> int:
    """The smallest multiple of ``size * accum`` (every rank gets ``accum`` equal micro-batches) that
    holds at least 8 sequences: 8 at 1, 2, 4 or 8 ranks."""
    m = size * accum
    return m * -(-8 // m)


def batch(step, dp_rank=0, dp_size=1, *, rows=None, world=None, accum=1, token_seed=0, ignore=0):
    """Rank ``dp_rank``'s share (of ``dp_size``) of global batch ``step``: ``rows`` sequences of
    :data:`SEQ` tokens from :func:`tokens` (``token_seed``), by default :func:`global_rows` of
    ``world`` (default ``dp_size``) and ``accum``, so the single-rank reference sees the same batch.
    ``ignore``: the first targets of every row are -100 (ignored targets take part)."""
    rows = global_rows(world or dp_size, accum) if rows is None else rows
    x, y = get_batch(tokens(token_seed), step, batch_size=rows, seq_len=SEQ, seed=0, dp_rank=dp_rank,
                     dp_size=dp_size)
    if ignore:
        y = y.copy()
        y[:, :ignore] = -100
    return x, y


# --- the single-rank reference -----------------------------------------------------------------
class Reference(NamedTuple):
    """A single-rank run: per-step losses, the first step's gradients, the final weights, the
    per-step clip norms (empty without clipping) and the loss on the evaluation batch (or None)."""
    losses: np.ndarray
    grads: dict
    weights: dict
    norms: np.ndarray
    eval_loss: float | None


def reference_run(dtype, *, cfg=CFG, steps=STEPS, lr=LR, weight_decay=WD, betas=(0.9, 0.999), seed=1, clip=None,
                  eval_step=None, **batch_kw) -> Reference:
    """AdamW on one rank over the whole global batch of each step (:func:`batch` with ``batch_kw``),
    clipping at ``clip`` after recording the gradients; ``eval_step``: the loss on that batch after
    training, under no_grad."""
    model = make_model(dtype, cfg, seed)
    opt = AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay)
    losses, norms, grads = [], [], None
    for step in range(steps):
        opt.zero_grad()
        _, loss = model(*batch(step, **batch_kw))
        loss.backward()
        if grads is None:
            grads = {n: p.grad.copy() for n, p in model.named_parameters()}
        if clip is not None:
            norms.append(clip_grad_norm(model.parameters(), clip))
        losses.append(loss.item())
        opt.step()
    eval_loss = None
    if eval_step is not None:
        with no_grad():
            eval_loss = model(*batch(eval_step, **batch_kw))[1].item()
    weights = {n: p.data.copy() for n, p in model.named_parameters()}
    return Reference(np.array(losses), grads, weights, np.array(norms), eval_loss)


# --- relative errors ---------------------------------------------------------------------------
def rel_err(got, ref, norm=np.inf) -> float:
    """||got - ref|| / ||ref|| over all elements, in float64: ``norm=inf`` (default) the largest
    elements, max|got - ref| / max|ref| (for short series: losses, norms); ``norm=2`` L2. The
    denominator is floored at 1e-300: against an all-zero ``ref`` any difference fails."""
    got, ref = np.asarray(got, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
    return float(np.linalg.norm(got - ref, norm) / max(np.linalg.norm(ref, norm), 1e-300))


def max_rel_err(got: dict, ref: dict, norm=2, whole=False) -> float:
    """Max over ``ref``'s tensors of :func:`rel_err` (L2 by default, ``norm=inf``: largest elements),
    the tensors compared as :func:`comparable` (``whole``: as they are).

    The L2 form is the parity criterion: AdamW divides each gradient element by its own running
    RMS, so an element whose gradient is ~1e-8 (a cancellation, far below the typical 1e-3) moves
    by ~lr whatever its rounding noise; in float32 the noise of a different summation order moves
    such isolated elements by ~1e-5 of the largest weight after a few steps, while the tensors as a
    whole agree to ~1e-7."""
    keep = (lambda name, a: a) if whole else comparable
    return max([0.0] + [rel_err(keep(name, np.asarray(got[name])), keep(name, np.asarray(r)), norm)
                        for name, r in ref.items()])


# --- multi-rank --------------------------------------------------------------------------------
def dp_comm() -> Comm:
    """MPI_COMM_WORLD as the dp axis."""
    return Comm(MPI.COMM_WORLD, "dp")


def worst(value: float) -> float:
    """The largest ``value`` over the ranks."""
    return MPI.COMM_WORLD.allreduce(float(value), op=MPI.MAX)


def global_loss(comm, loss: float) -> float:
    """The mean of the ranks' ``loss`` over ``comm``."""
    return comm.allreduce_scalar(loss) / comm.size
