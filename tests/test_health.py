"""Which checkpoint versions are good (mpirt.run.health): the loss's recent range, the versions'
records, the pruning that keeps the good ones through a diverging stretch, float16's range."""
import numpy as np

from mpirt.checkpoint.sharded import save_sharded
from mpirt.checkpoint.store import read_checkpoint_meta, save_state, version_dirs
from mpirt.comm import world_comm
from mpirt.run.health import LossRange, last_good_version, resume_advice, version_good


def test_noise_stays_in_range_a_divergence_leaves_and_does_not_widen_it():
    seen = LossRange.seeded([{"step": s, "loss": 5.5 - 0.01 * s + 0.05 * (-1) ** s} for s in range(1, 21)])
    assert not seen.out and seen.observe(21, 5.6)               # noise around the recent losses
    assert not seen.observe(22, 1e18) and not seen.observe(23, 40.0) and not seen.observe(24, float("nan"))
    assert seen.bounds()[1] == 5.6 and seen.out == [[22, 24]]   # the range is still the one from before
    assert seen.observe(25, 5.3) and seen.left_at(23) and not seen.left_at(25)
    assert "left its recent range" in seen.describe() and "at step 22" in seen.describe()
    fresh = LossRange()
    assert all(fresh.observe(s, 10.0 ** s) for s in range(1, 5))  # too few losses to judge but finiteness


def test_the_good_versions_survive_pruning_and_are_named_with_the_flag_that_resumes(tmp_path):
    weights = {"w": np.ones(3, np.float32)}
    for step, good in ((2, True), (4, True), (6, False), (8, False)):
        save_state(tmp_path, weights, None, step=step, config={}, extra={"loss": 5.0, "good": good}, keep=2)
    assert [p.name for p in version_dirs(tmp_path)] == ["step-00000002", "step-00000004", "step-00000006",
                                                         "step-00000008"]   # keep 2 prunes no good version
    assert last_good_version(tmp_path) == tmp_path / "step-00000004"
    seen = LossRange()
    seen.observe(5, float("nan"))                        # version 4's weights gave the first bad loss
    assert last_good_version(tmp_path, seen) == tmp_path / "step-00000002"
    assert resume_advice(tmp_path, seen) == ("the last good checkpoint is step 2: resume from it with "
                                             f"--init-from {tmp_path / 'step-00000002'}")
    save_state(tmp_path, weights, None, step=10, config={}, extra={"good": True}, keep=2)
    assert [p.name for p in version_dirs(tmp_path)] == ["step-00000008", "step-00000010"]   # healthy again
    assert resume_advice(tmp_path / "none") == "no checkpoint was written"


def test_float16_masters_beyond_its_range_are_never_a_good_version(tmp_path):
    comm = world_comm()
    paths = []
    for step, value in ((1, 6e4), (2, 7e4)):
        def fill(writer, value=value):
            writer.add("params", "w", (2,), (None,), (0,), np.array([1.0, value], np.float32))
        paths.append(save_sharded(tmp_path, comm, fill, step=step, config={}, extra={"good": True}, optimizer=None,
                                  keep=5, params_limit=float(np.finfo(np.float16).max)))
    metas = [read_checkpoint_meta(p) for p in paths]
    assert [m["extra"]["params_max_abs"] for m in metas] == [6e4, 7e4]
    assert [m["extra"]["good"] for m in metas] == [True, False]
    assert version_good(metas[0], dtype="float16") and not version_good(metas[1], dtype="float16")
    assert last_good_version(tmp_path, dtype="float16") == paths[0]
