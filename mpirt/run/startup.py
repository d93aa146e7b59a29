"""How the ranks of ``python -m mpirt.train`` start together, so that no failure on one rank
leaves the others waiting (:func:`mpirt.run.train.main` runs these in order):

- until the first training step, TERM and INT keep their default action (:func:`end_on_signal`):
  there is nothing to save yet, and a Python handler would not run while the main thread waits
  inside MPI (the signal would be lost, and a hung start-up would outlive ``timeout``);
- the communication watchdog starts before anything that can fail on one rank, with the
  pre-flight's own short timeout (:func:`preflight_timeout`), so that a rank that never arrives,
  or exits, is named;
- every rank reaches the same agreements whatever failed: "I could not start: reason" from any
  rank (:func:`mpirt.comm.first_error`) ends every rank with exit 2, rank 0 printing one line that
  names the rank (:func:`refuse_if_any`);
- the checkpoint a run loads is resolved once, on rank 0 (:func:`pin_checkpoint`: ``latest`` read
  once, also for ``--resume auto``), and every rank loads that version, checking that its
  meta.json is the one rank 0 read (:func:`follow_pin`): a run still saving cannot hand two ranks
  two versions.
"""
from __future__ import annotations

import dataclasses
import hashlib
import signal
import sys
from pathlib import Path

from mpirt.checkpoint.store import (META, CheckpointError, intact_version, looks_like_checkpoint,
                                    read_checkpoint_meta)
from mpirt.run import jobctl
from mpirt.run.config import ConfigError

PREFLIGHT_S = 60.0        # the pre-flight's watchdog timeout (auto): no checkpoint to wait for
VERIFY_BYTES_PER_S = 50e6  # the slowest read assumed while a rank checksums the checkpoint it loads


def end_on_signal() -> None:
    """TERM and INT end this process at once (their default action) until the training loop
    installs its stop handling (:class:`mpirt.run.jobctl.StopRequests`)."""
    for sig in jobctl.STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def preflight_timeout(cfg=None, pin: dict | None = None) -> float:
    """The watchdog's timeout before training: ``--comm-timeout`` when given (0: none); for auto,
    :data:`PREFLIGHT_S` plus the time one rank may take to checksum the pinned checkpoint at
    :data:`VERIFY_BYTES_PER_S` (every rank verifies it side by side, and one may lag)."""
    if cfg is not None and cfg.comm_timeout >= 0:
        return cfg.comm_timeout
    return PREFLIGHT_S + (pin["bytes"] / VERIFY_BYTES_PER_S if pin else 0.0)


def refuse_if_any(failed: tuple[int, str] | None, rank: int, lock: Path | None = None) -> None:
    """End this rank with exit 2 when ``failed`` (the answer of :func:`mpirt.comm.first_error`,
    the same on every rank) names a rank that could not start; rank 0 releases the run's lock
    if it holds it and prints the one line, naming the rank when it is not rank 0."""
    if failed is None:
        return
    first, message = failed
    if rank == 0:
        if lock is not None:
            jobctl.release_lock(lock)
        print(f"error: {message}" if first == 0 else f"error on rank {first}: {message}", file=sys.stderr, flush=True)
    sys.exit(jobctl.EXIT_REFUSED)


def damaged_checkpoint(init_from, err: Exception) -> ConfigError:
    """The refusal of a checkpoint that cannot be read: the error, and where the damaged version is
    the newest, the intact older one and the flag that resumes from it."""
    older = intact_version(init_from)
    return ConfigError(f"init_from: {err}" + (f"; {older} is intact: resume from it with --init-from {older}"
                                              if older else ""))


def pin_checkpoint(init_from: str) -> dict:
    """Rank 0's answer to "which checkpoint does this run load", for :func:`follow_pin` on every
    rank: ``init_from`` as rank 0 has it and, when it names an mpirt checkpoint, ``version`` (the
    version directory, absolute, that ``latest`` names now), ``sha256`` (of its meta.json) and
    ``bytes`` (of its files); ConfigError naming the file when it cannot be resolved."""
    pin = {"init_from": init_from, "version": None, "sha256": None, "bytes": 0}
    if not init_from or not looks_like_checkpoint(init_from):
        return pin
    try:
        meta = read_checkpoint_meta(init_from)
        version = Path(meta["path"]).resolve()
        digest = hashlib.sha256((version / META).read_bytes()).hexdigest()
    except (CheckpointError, OSError) as err:
        raise damaged_checkpoint(init_from, err) from None
    return dict(pin, version=str(version), sha256=digest, bytes=sum(f["bytes"] for f in meta["files"].values()))


def follow_pin(cfg, pin: dict):
    """``cfg`` loading what rank 0 pinned (:func:`pin_checkpoint`): under ``--resume auto`` rank 0
    decides whether the run resumes; an ``init_from`` equal to rank 0's becomes the pinned version
    directory once this rank has read the same meta.json there (ConfigError naming the file
    otherwise). Another ``init_from`` than rank 0's is left as it is: the config agreement
    refuses it, naming the key."""
    if cfg.resume == "auto":
        cfg = dataclasses.replace(cfg, init_from=pin["init_from"])
    if pin["version"] is None or cfg.init_from != pin["init_from"]:
        return cfg
    meta = Path(pin["version"]) / META
    try:
        digest = hashlib.sha256(meta.read_bytes()).hexdigest()
    except OSError as err:
        raise ConfigError(f"init_from: {meta}, the version rank 0 resolved, is unreadable here "
                          f"({err.strerror or err})") from None
    if digest != pin["sha256"]:
        raise ConfigError(f"init_from: {meta} reads differently here than on rank 0 (sha256 {digest[:16]}, "
                          f"rank 0 {pin['sha256'][:16]}): every rank must load the same checkpoint")
    return dataclasses.replace(cfg, init_from=pin["version"])
