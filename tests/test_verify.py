"""``python -m mpirt.verify``: layouts held to one rank on the user's model, injected parallel bugs
caught by step and tensor, a checkpoint's next step replayed at another layout, bad input refused.

The multi-rank tests call the command's plan and execution in-process on groups of the world
(:func:`mpirt.verify.cli.make_plan`, :func:`mpirt.verify.cli.execute`), several layouts side by
side in one pytest launch; the launch tests run the command itself under mpiexec."""
import json
import os

import pytest

from mpirt.core.settings import ConfigError
from mpirt.verify.cli import execute, make_plan, split_args
from mpirt.verify.compare import build_report, comparable
from mpirt.verify.sides import layout_config, short_shape
from mpirt.run.config import TrainConfig

from conftest import agree, run_module

TINY = ["--model", "tiny", "--model.n_embd", "32", "--model.n_head", "4", "--progress", "false"]


# --- units ---------------------------------------------------------------------------------------
def test_own_flags_are_split_from_the_training_flags():
    own, rest, given = split_args(["run.toml", "--steps", "2", "--reference=tp=2", "--tp", "2", "--seq-len=32",
                                   "--sequence-parallel"])
    assert own == {"steps": 2, "reference": "tp=2"}
    assert rest == ["run.toml", "--tp", "2", "--seq-len=32", "--sequence-parallel"]
    assert given == {"tp", "seq_len", "sequence_parallel"}
    with pytest.raises(ConfigError, match="--layers: must be >= 1"):
        split_args(["--layers", "0"])


def test_a_layout_string_names_the_axes_and_leaves_the_rest_single():
    cfg = TrainConfig(dp=2, tp=2, zero=2, sequence_parallel=True)
    ref = layout_config(cfg, "tp=2, zero=1", "reference")
    assert (ref.dp, ref.tp, ref.pp, ref.zero, ref.sequence_parallel) == (1, 2, 1, 1, False)
    with pytest.raises(ConfigError, match="reference: 'tq=2' is not KEY=VALUE"):
        layout_config(cfg, "tq=2", "reference")
    with pytest.raises(ConfigError, match="against: zero: must be in 0..3"):
        layout_config(cfg, "zero=7", "against")


def test_the_short_shape_fits_every_side():
    cp_sp = TrainConfig(cp=2, tp=2, sequence_parallel=True, dp=1)
    pp = TrainConfig(pp=2, microbatches=4, dp=2)
    assert short_shape([(cp_sp, 4), (TrainConfig(dp=1), 1)], None, None, 256) == (16, 4)
    assert short_shape([(TrainConfig(cp=3, dp=1), 3), (pp, 4)], None, None, 256) == (18, 8)
    assert short_shape([(pp, 4)], 32, 16, 256) == (32, 16)


def test_the_report_names_the_first_step_and_tensor_that_part():
    def side(losses):
        return [{"step": i + 1, "loss": v, "grad_norm": 1.0, "tokens_per_expert": None} for i, v in enumerate(losses)]
    tensors = [{"step": s, "tensor": n, "rel_diff": d, "index": [0, 1], "rank": 1}
               for s, n, d in ((1, "a.weight", 1e-16), (1, "b.weight", 0.0), (2, "a.weight", 3e-2), (2, "b.weight", 2e-3))]
    where = lambda r: {"dp": 0, "pp": 0, "cp": 0, "tp": r, "ep": 0}  # noqa: E731
    report = build_report(side([2.0, 1.9]), side([2.0, 1.9]), tensors, 1e-9, where)
    assert not report["equal"] and report["first_difference"]["step"] == 2
    assert report["verdict"].startswith("step 2: a.weight differs by 3.0e-02 (element (0, 1), held by rank 1:")
    assert [t["tensor"] for t in report["worst_tensors"]] == ["a.weight", "b.weight"]
    assert build_report(side([2.0]), side([2.0]), tensors[:2], 1e-9, where)["equal"]
    nan = build_report(side([float("nan")]), side([2.0]), tensors[:2], 1e-9, where)
    assert nan["verdict"].startswith("step 1: the loss differs")


def test_the_attention_key_bias_is_left_out_of_the_comparison():
    import numpy as np
    a = np.arange(6.0)
    assert comparable("h.0.attn.c_attn.bias", a).tolist() == [0, 1, 0, 0, 4, 5]
    assert comparable("h.0.mlp.c_fc.bias", a) is a


# --- layouts against one rank, in-process on groups of the world ----------------------------------
def _verify(group, size, argv, tmp_path_factory=None, inject=None) -> dict | None:
    """The report of ``argv`` on this rank's group of ``size`` ranks (None on leftover ranks)."""
    from mpi4py import MPI
    work = MPI.COMM_WORLD.bcast(str(tmp_path_factory.mktemp("verify")) if MPI.COMM_WORLD.rank == 0 else None)
    comm = group(size)
    if comm is None:
        return None
    if inject:
        os.environ["MPIRT_VERIFY_INJECT"] = inject
    try:
        plan = make_plan([*argv, "--work", f"{work}/g{MPI.COMM_WORLD.rank // size}"], size)
        return execute(plan, comm)
    finally:
        os.environ.pop("MPIRT_VERIFY_INJECT", None)


def _by_group(cases: list, size: int):
    """This rank's case: the world's groups of ``size`` ranks take the cases in turn."""
    from mpi4py import MPI
    return cases[MPI.COMM_WORLD.rank // size % len(cases)]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pair", [0, 1, 2, 3, 4])
def test_two_rank_layouts_equal_one_rank(pair, group, tmp_path_factory):
    """dp2 ZeRO-2 and tp2 + SP side by side, then pp2 (1f1b) and cp2, then pp2 under the interleaved
    and zero-bubble schedules, dp2 (DataParallel's buckets) and dp2 ZeRO-3, pp2 under GPipe and
    tp2 with whole-block recomputation (each group of 2 ranks takes one). Each also holds its
    recorded communication to the program its layout predicts."""
    cases = [[["--dp", "2", "--zero", "2"], ["--tp", "2", "--sequence-parallel"]],
             [["--pp", "2", "--layers", "2"], ["--cp", "2", "--layers", "2"]],  # two blocks: two rings a pass
             [["--pp", "2", "--schedule", "interleaved"], ["--pp", "2", "--schedule", "zb-h1", "--microbatches", "4"]],
             [["--dp", "2"], ["--dp", "2", "--zero", "3"]],
             [["--pp", "2", "--schedule", "gpipe"], ["--tp", "2", "--recompute", "full"]],
             ][pair]
    flags = _by_group(cases, 2)
    report = _verify(group, 2, TINY + flags, tmp_path_factory)
    agree(report is None or report["equal"], f"{flags}: {report and report['verdict']}")


@pytest.mark.mpi(min_size=4)
def test_experts_over_ep_equal_one_rank(group, tmp_path_factory):
    """dp2 x ep2 of mixtral-tiny: routing (tokens per expert) and the experts' weights compared."""
    report = _verify(group, 2, ["--model", "mixtral-tiny", "--model.n_embd", "32", "--progress", "false",
                                "--dp", "2", "--ep", "2", "--zero", "1", "--layers", "2"], tmp_path_factory)
    agree(report is None or report["equal"] and all(s["routing_equal"] for s in report["steps"]),
          report and (report["verdict"], report["steps"]))


@pytest.mark.mpi(min_size=4)
def test_grouped_query_attention_over_cp_and_tp_equals_one_rank(group, tmp_path_factory):
    report = _verify(group, 4, ["--model", "llama-tiny", "--model.n_embd", "32", "--model.n_kv_head", "2",
                                "--progress", "false", "--cp", "2", "--tp", "2", "--sequence-parallel"], tmp_path_factory)
    agree(report is None or report["equal"], report and report["verdict"])


@pytest.mark.mpi(min_size=8)
def test_eight_rank_layout_with_dropout_and_recompute_equals_one_rank(group, tmp_path_factory):
    report = _verify(group, 8, TINY + ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1",
                                       "--model.resid_pdrop", "0.1", "--model.attn_pdrop", "0.1",
                                       "--recompute", "selective", "--recompute-layers", "0-1"], tmp_path_factory)
    agree(report is None or report["equal"], report and report["verdict"])


# --- proven able to fail -----------------------------------------------------------------------------
BUGS = {"tp-row-scale": ["--tp", "2"], "sp-dropped-reduce-scatter": ["--tp", "2", "--sequence-parallel"],
        "cp-ring-step": ["--cp", "2"], "zero-shard-offset": ["--dp", "2", "--zero", "1"],
        "pp-microbatch-order": ["--pp", "2", "--layers", "2"],
        "ep-expert-swap": ["--model", "mixtral-tiny", "--model.n_embd", "32", "--dp", "2", "--ep", "2"]}


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pair", [0, 1, 2])
def test_each_injected_bug_is_named_by_step_and_tensor(pair, group, tmp_path_factory):
    bug = _by_group(list(BUGS)[2 * pair:2 * pair + 2], 2)
    report = _verify(group, 2, TINY + BUGS[bug], tmp_path_factory, inject=bug)
    first = report and report["first_difference"]
    agree(report is None or not report["equal"] and first["step"] == 1 and first["tensor"]
          and report["verdict"].startswith(f"step 1: {first['tensor']} differs by"),
          f"{bug}: {report and report['verdict']}")


@pytest.mark.mpi(min_size=2)
def test_a_changed_ring_pattern_is_caught_by_the_recorded_communication(group, tmp_path_factory):
    """cp 2 with ring attention passing its keys and values once more than it needs: every number
    stays equal, and the cp sends and receives each rank recorded in step 1 part from the pre-flight
    proof's program of that rank."""
    report = _verify(group, 2, TINY + ["--cp", "2"], tmp_path_factory, inject="cp-ring-extra-pass")
    agree(report is None or not report["equal"] and report["steps"][0]["worst_tensor_rel_diff"] < 1e-9
          and report["steps"][0]["loss_rel_diff"] < 1e-9 and report["verdict"].startswith(
              "step 1: the layout's communication is not what its layout predicts: rank 0: cp recv of ")
          and "rank 1: cp send of " in " ".join(report["communication"]), report and report["verdict"])


@pytest.mark.mpi(min_size=2)
def test_a_dropped_tp_collective_is_caught_by_the_recorded_communication(group, tmp_path_factory):
    """tp 2 + SP with a row-parallel layer keeping its own chunk instead of reduce-scattering: the
    numbers part (named first), and the communication each rank recorded lacks those
    reduce-scatters against the program its tensor-parallel modules declare."""
    report = _verify(group, 2, TINY + BUGS["sp-dropped-reduce-scatter"], tmp_path_factory,
                     inject="sp-dropped-reduce-scatter")
    found = report and " ".join(report["communication"])
    agree(report is None or not report["equal"] and "rank 0: tp reduce_scatter of " in found, report and found)


@pytest.mark.mpi(min_size=4)
def test_a_norm_sum_sent_as_int64_is_caught_by_the_recorded_dtypes(group, tmp_path_factory):
    """The wrong gradient norm under pp x dp x ZeRO put back (a 4096-token vocabulary puts a ZeRO-1
    shard of the last stage wholly inside the tied embedding copy, which the norm does not count):
    that rank sums its squares over dp as int64 while its peer sends float64. The recorded
    communication names the rank and the dtype; without the bug the same layout is equal."""
    flags = TINY + ["--model.vocab_size", "4096", "--pp", "2", "--dp", "2", "--zero", "1"]
    report = _verify(group, 4, flags, tmp_path_factory, inject="scalar-dtype-from-value")
    found = report and " ".join(report["communication"])
    agree(report is None or not report["equal"] and "dp allreduce of 8 B int64: 1 recorded, 0 predicted" in found,
          report and (report["verdict"], found))
    report = _verify(group, 4, flags, tmp_path_factory)
    agree(report is None or report["equal"] and not report["communication"], report and report["verdict"])


# --- the command itself -------------------------------------------------------------------------------
def test_verify_command_passes_a_layout_and_fails_an_injected_bug(tmp_path):
    ok = run_module("mpirt.verify", *TINY, "--dp", "2", "--zero", "2", "--json", tmp_path / "ok.json",
                    "--work", tmp_path / "w", ranks=2)
    assert "mpirt verify: equal: every step's loss" in ok.stdout, ok.stdout
    report = json.loads((tmp_path / "ok.json").read_text())
    assert report["equal"] and len(report["steps"]) == 3 and report["tolerance"] == 1e-9
    bad = run_module("mpirt.verify", *TINY, "--tp", "2", "--work", tmp_path / "w", ranks=2, expect=1,
                     env={"MPIRT_VERIFY_INJECT": "tp-row-scale"})
    assert "mpirt verify: DIFFERS: step 1: " in bad.stdout, bad.stdout
    assert not list((tmp_path / "w").iterdir())  # the snapshots are removed


def test_train_verify_trains_a_layout_that_passes_and_refuses_one_that_does_not(tiny_data, tmp_path):
    """``mpirt.train --verify`` at tp 2: the check's line, then training; with a row-parallel backward
    missing its 1/tp, one line naming the step and tensor, exit 2, nothing trained."""
    train = [*TINY, "--data", tiny_data, "--tp", "2", "--steps", "2", "--batch-size", "4", "--seq-len", "16",
             "--eval-batches", "1", "--monitor", "false", "--verify"]
    ok = run_module("mpirt.train", *train, "--out-dir", tmp_path / "ok", ranks=2)
    assert "mpirt: --verify: dp 1 x pp 1 x tp 2 equals one rank on 1 block (every step's loss" in ok.stderr, ok.stderr
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["steps"] == 2
    assert not (tmp_path / "ok" / "verify").exists()
    bad = run_module("mpirt.train", *train, "--out-dir", tmp_path / "bad", ranks=2, expect=2,
                     env={"MPIRT_VERIFY_INJECT": "tp-row-scale"})
    assert bad.stderr.startswith("error: --verify: the layout dp 1 x pp 1 x tp 2 does not compute what one rank "
                                 "computes: step 1: ") and bad.stderr.count("\n") == 1, bad.stderr
    assert not list((tmp_path / "bad").glob("*/*")), list((tmp_path / "bad").rglob("*"))  # no checkpoint, no metrics


@pytest.mark.parametrize("ranks, args, message", [
    (0, ["--tp", "3"], "error: layout: dp/pp/tp: "),
    (0, ["--reference", "tp=2"], "error: reference: 'tp=2' needs 2 ranks, the launch has 1"),
    (0, ["--reference", "tq=2"], "error: reference: 'tq=2' is not KEY=VALUE"),
    (0, ["--against", "dp=1"], "error: --against: names the second layout of a --replay"),
    (2, ["--model.n_embd", "512", "--model.n_head", "8", "--tp", "2", "--memory-budget", "130MiB"],
     "error: reference one rank: memory_budget: rank 0: predicted peak"),
])
def test_bad_input_is_one_line_and_exit_2(ranks, args, message, tmp_path):
    result = run_module("mpirt.verify", *TINY, *args, "--work", tmp_path, ranks=ranks, expect=2)
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr


def _even_corpus(out) -> None:
    """A corpus of one sentence's words in seeded random order: no stretch of it is unusual, so
    the run's gradient norms stay in a narrow band (the repository's own sources, which change
    with every commit, hold stretches that spike a step's gradient norm 8x by themselves)."""
    import numpy as np
    from mpirt.data.tokens import prepare
    words = "the model splits its layers over ranks and each rank sends activations to the next stage " \
            "while gradients flow back".split()
    src = out.parent / "even-src"
    src.mkdir()
    (src / "words.txt").write_text(" ".join(np.random.default_rng(0).choice(words, 60000)))
    prepare(src, out, pattern="*.txt", val_fraction=0.2)


def _spike(data_dir, step: int, *, batch_size: int, seq_len: int, seed: int = 1337) -> None:
    """Overwrite the windows training batch ``step`` (0-based) reads with token 1, which the corpus
    never holds: a bad stretch of data (the window starts as :func:`mpirt.data.tokens.get_batch`
    draws them)."""
    import numpy as np
    tokens = np.memmap(data_dir / "train.bin", dtype=np.uint16, mode="r+")
    raw = np.random.PCG64(np.random.SeedSequence([seed, step])).random_raw(batch_size)
    for start in (raw % np.uint64(len(tokens) - seq_len)).astype(np.int64):
        tokens[start:start + seq_len + 1] = 1
    tokens.flush()


def test_replay_of_a_dp2_tp2_checkpoint_is_the_runs_next_step_at_pp2_and_refuses_another_model(tmp_path):
    """A dp2 x tp2 run (dropout on) checkpoints after each of 7 steps; replaying the first version at
    dp2 x tp2 and at pp2 gives equal steps, and the loss and gradient norm the run logged at step 2.
    With the data step 7 reads made bad, replaying step 6's version shows step 7 abnormal alike at
    dp2 x tp2 and on one rank: the data, not the layout."""
    data, out = tmp_path / "data", tmp_path / "run"
    _even_corpus(data)
    run_module("mpirt.train", *TINY, "--model.n_layer", "2", "--data", data, "--dp", "2", "--tp", "2",
               "--dtype", "float64", "--steps", "7", "--ckpt-interval", "1", "--keep-checkpoints", "7",
               "--lr", "1e-2", "--warmup-steps", "0", "--batch-size", "4", "--seq-len", "16",
               "--eval-batches", "1", "--monitor", "false", "--out-dir", out, "--model.resid_pdrop", "0.1", ranks=4)
    result = run_module("mpirt.verify", "--replay", out / "ckpt" / "step-00000001", "--against", "dp=1 pp=2",
                        "--json", tmp_path / "replay.json", "--work", tmp_path / "w", ranks=4)
    report = json.loads((tmp_path / "replay.json").read_text())
    logged = json.loads((out / "metrics" / "rank0.jsonl").read_text().splitlines()[1])
    step = report["steps"][0]
    assert report["equal"] and step["step"] == 2 and "step 2 on the run's layout dp 2 x pp 1 x tp 2" in result.stdout
    assert abs(step["loss"] - logged["loss"]) < 1e-12 and abs(step["grad_norm"] - logged["grad_norm"]) < 1e-12, \
        (step, logged)
    assert report["abnormal"] is None and "abnormal" not in result.stdout

    _spike(data, 6, batch_size=4, seq_len=16)
    spiked = run_module("mpirt.verify", "--replay", out / "ckpt" / "step-00000006", "--json", tmp_path / "spike.json",
                        "--work", tmp_path / "w", ranks=4)
    report = json.loads((tmp_path / "spike.json").read_text())
    logged = [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert report["equal"] and report["steps"][0]["step"] == 7, report["verdict"]
    assert report["steps"][0]["grad_norm"] > 1.5 * max(r["grad_norm"] for r in logged[1:6]), (report["steps"], logged)
    assert report["abnormal"].startswith("step 7's ") and "outside the run's recent range" in report["abnormal"]
    assert "mpirt verify: abnormal step: step 7's " in spiked.stdout and "it is the data (or the run's state), " \
        "not the layout" in spiked.stdout, spiked.stdout

    other = run_module("mpirt.verify", "--replay", out / "ckpt", "--model", "mixtral-tiny", expect=2)
    assert other.stderr.startswith(f"error: replay: {out / 'ckpt'}") and "holds another model than --model " \
        "mixtral-tiny" in other.stderr and other.stderr.count("\n") == 1, other.stderr


def test_a_replayed_step_out_of_the_runs_recent_range_is_abnormal():
    from mpirt.verify.compare import abnormal_steps
    record = [{"step": s, "loss": 5.0 - 0.1 * s, "grad_norm": 2.0 + 0.1 * (s % 2)} for s in range(1, 7)]
    assert abnormal_steps([{"step": 7, "loss": 4.4, "grad_norm": 2.05}], record) is None
    assert abnormal_steps([{"step": 7, "loss": 4.4, "grad_norm": 6.0}], record) == \
        "step 7's gradient norm 6 is outside the run's recent range 2..2.1 (steps 1-6)"
    assert abnormal_steps([{"step": 7, "loss": float("nan"), "grad_norm": 2.0}], record).startswith(
        "step 7's loss nan is outside the run's recent range 4.4..4.9")
    assert abnormal_steps([{"step": 3, "loss": 9.0, "grad_norm": 9.0}], record[:2]) is None  # too short to judge


def test_calls_out_of_the_programs_order_are_named(monkeypatch):
    """The order check (pure: the recorded calls stood in for): an ep2 x pp2 step's calls in the
    program's order pass, and with a pipeline receive posted early among the sends; the experts'
    counts exchanged after their rows, or a send the program does not make, are named with the
    stream, the place and the program's op."""
    from dataclasses import replace
    from types import SimpleNamespace
    from mpirt.core.modeling import load_model_config
    from mpirt.parallel.layout import Layout
    from mpirt.parallel.preflight import StepPrograms
    from mpirt.verify import traffic

    model = load_model_config("mixtral-tiny", {"n_layer": 2})
    cfg = replace(TrainConfig(), dp=2, ep=2, pp=2, batch_size=4, seq_len=16, dtype="float64")
    layout = Layout.resolve(cfg, 4, model)
    make = StepPrograms(layout, model, "float64", blocks_apart=True)
    calls = []
    for op in make.program(0) + make.sums(0):
        if op.what == "exchange":
            calls += [(op.comm, "recv", n, op.dtype) for _, n in op.recvs] + [(op.comm, "send", n, op.dtype)
                                                                               for _, n in op.sends]
        elif op.what != "wait":
            calls.append((op.comm, traffic.KIND.get(op.what, op.what), op.nbytes, op.dtype))
    engine = SimpleNamespace(local=SimpleNamespace(tied_calls=lambda: []))

    def order_of(recorded):
        monkeypatch.setattr(traffic, "recorded", lambda cursor: recorded)
        return traffic.order_differences(layout, model, "float64", 0, 0, engine)

    assert order_of(calls) == []
    sends = [i for i, c in enumerate(calls) if c[:2] == ("pp", "send")]
    early = calls[:sends[0]] + calls[sends[0] + 1:sends[1]] + [calls[sends[0]]] + calls[sends[1]:]
    assert order_of(early) == []   # a receive between two sends: each stream keeps its order
    counts = next(i for i, c in enumerate(calls) if c[0] == "ep" and c[3] == "int64")
    swapped = calls[:counts] + [calls[counts + 1], calls[counts]] + calls[counts + 2:]
    assert order_of(swapped) == ["ep collective #0: recorded 32768 B float64, the program 32 B int64 "
                                 "(F mb 0 h.0-0 expert counts)"]
    assert order_of(calls + [("pp", "send", 8, "float64")]) == ["pp send #2: recorded 8 B float64, the program none"]
