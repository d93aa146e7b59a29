"""The pre-flight proof of a whole step's communication (mpirt.parallel.preflight): the programs
the layouts make pass, and mis-ordered variants (collectives swapped, a ring exchange before a
gather its peer waits in, a message of the wrong size, the experts' all-to-alls swapped or run
ahead of the pipeline) are refused naming the ranks and operations. Pure: no MPI."""
from dataclasses import replace

import pytest

from mpirt.core.modeling import load_model_config
from mpirt.parallel.layout import Layout
from mpirt.parallel.preflight import (StepCommError, StepPrograms, check_step, proof_rank, reduced, simulate_step,
                                      step_programs)
from mpirt.run.config import TrainConfig

MODEL = load_model_config("tiny", {})  # 4 blocks
MOE = load_model_config("mixtral-tiny", {})  # 4 blocks of 4 experts
SEQ = 64


def layout_of(world: int, model=MODEL, **changes) -> Layout:
    cfg = replace(TrainConfig(), batch_size=16, seq_len=SEQ, **changes)
    return Layout.of(cfg, Layout.resolve(cfg, world), model)


@pytest.mark.parametrize("world, changes", [
    (2, dict(cp=2)),
    (4, dict(cp=4, recompute="selective")),
    (4, dict(dp=2, cp=2, zero=3)),
    (8, dict(cp=2, pp=2, zero=3, schedule="zb-h1", microbatches=4)),
    (8, dict(cp=2, pp=2, schedule="interleaved", microbatches=4, chunks=2, recompute="full")),
    (8, dict(dp=2, cp=2, tp=2, zero=3)),
    (4, dict(pp=4, microbatches=8, schedule="gpipe")),
    (4, dict(dp=2, pp=2, zero=3, schedule="1f1b", microbatches=4)),
], ids=str)
def test_the_layouts_steps_pass(world, changes):
    lay = layout_of(world, **changes)
    check_step(lay, MODEL, "float32")
    programs = step_programs(reduced(lay), MODEL, "float32")
    simulate_step(reduced(lay), programs)  # every rank simulated, as the proof's stages stand for them
    kinds = {op.what + ":" + op.comm for ops in programs.values() for op in ops}
    assert ("exchange:cp" in kinds) == (lay.cp > 1) and ("allgather:dp_cp" in kinds) == (lay.zero == 3)


@pytest.mark.parametrize("world, changes", [
    (2, dict(ep=2)),
    (4, dict(ep=4, zero=1)),
    (8, dict(dp=4, ep=2, pp=2, schedule="zb-h1", microbatches=4)),
    (8, dict(dp=2, ep=2, pp=2, tp=2, schedule="interleaved", microbatches=4, chunks=2, recompute="full")),
], ids=str)
def test_the_expert_parallel_steps_pass(world, changes):
    """The experts' all-to-alls on the ep groups, between the pipeline's messages: 3 a MoE chunk
    forward, 2 backward (and 3 again where it reruns)."""
    lay = layout_of(world, MOE, **changes)
    check_step(lay, MOE, "float32")
    small = reduced(lay)
    programs = step_programs(small, MOE, "float32")
    exchanges = [op for op in programs[0] if op.what == "alltoall"]
    per_chunk = 3 + 2 + (3 if lay.recomputed else 0)
    assert exchanges and all(op.comm == "ep" for op in exchanges)
    assert len(exchanges) == per_chunk * small.microbatches * small.chunks


def programs_of(model=MODEL, **changes):
    lay = reduced(layout_of(2, model, **changes))
    return lay, step_programs(lay, model, "float32")


def test_collectives_in_another_order_on_one_rank_are_refused():
    lay, programs = programs_of(cp=2, zero=3)
    ops = programs[1]
    started = [i for i, op in enumerate(ops) if op.what in ("allgather", "iallgather", "reduce_scatter")]
    assert [ops[i].what for i in started[:2]] == ["allgather", "iallgather"]  # the embedding, then the blocks' prefetch
    ops[started[0]], ops[started[1]] = ops[started[1]], ops[started[0]]
    with pytest.raises(StepCommError, match=r"^dp_cp group \[0, 1\], collective #0: rank 0 runs allgather of \d+ B float32 "
                                            r"on dp_cp \(F mb 0 embed\), rank 1 iallgather of \d+ B float32 on dp_cp "
                                            r"\(F mb 0 embed, prefetching h\.0-3\)$"):
        simulate_step(lay, programs)


def test_experts_rows_sent_before_their_counts_on_one_rank_are_refused():
    lay, programs = programs_of(MOE, ep=2)
    ops = programs[1]
    ops[0], ops[1] = ops[1], ops[0]  # rank 1 sends its rows before the counts
    with pytest.raises(StepCommError, match=r"^ep group \[0, 1\], collective #0: rank 0 runs alltoall of 32 B int64 on ep "
                                            r"\(F mb 0 h\.0-3 expert counts\), rank 1 alltoall of \d+ B float32 on ep "
                                            r"\(F mb 0 h\.0-3 rows out\)$"):
        simulate_step(lay, programs)


def test_an_activation_sent_after_the_experts_exchange_it_feeds_deadlocks():
    """dp 2 x ep 2 x pp 2: first-stage rank 1 sends its first activation only at the end of its
    step; its last stage waits for it, so that stage's ep peer waits in the experts' exchange,
    never sends the gradient back, and the first stages wait in theirs: a cycle over pp and ep."""
    lay = reduced(layout_of(4, MOE, ep=2, pp=2))
    programs = step_programs(lay, MOE, "float32")
    first = next(r for r in programs if lay.position(r) == {"dp": 1, "pp": 0, "cp": 0, "tp": 0, "ep": 1})
    ops = programs[first]
    send = next(i for i, op in enumerate(ops) if op.what == "exchange" and op.sends)
    ops.append(ops.pop(send))
    with pytest.raises(StepCommError, match="^deadlock: ") as err:
        simulate_step(lay, programs)
    assert "rank 1 waits in alltoall of 32 B int64 on ep (F mb 1 h.2-3 expert counts)" in str(err.value)  # rank 3's ep peer
    assert f"rank 3 waits in receive 131072 B float32 from rank {first} on pp" in str(err.value)


def test_a_ring_exchange_before_the_gather_its_peer_waits_in_deadlocks():
    lay, programs = programs_of(cp=2, zero=3)
    ops = programs[1]
    ring = next(i for i, op in enumerate(ops) if op.what == "exchange")
    ops.insert(0, ops.pop(ring))  # rank 1 passes keys and values before gathering the embedding
    with pytest.raises(StepCommError) as err:
        simulate_step(lay, programs)
    assert str(err.value).startswith("deadlock: rank 0 waits in allgather of ")
    assert "rank 1 waits in send " in str(err.value) and "ring step 0" in str(err.value)


def test_a_prefetched_gather_lets_the_peer_run_ahead():
    """A started gather does not block: rank 1 may pass keys and values before waiting for the
    blocks' prefetched gather (both ranks started it), which the proof accepts."""
    lay, programs = programs_of(cp=2, zero=3)
    ops = programs[1]
    ring = next(i for i, op in enumerate(ops) if op.what == "exchange")
    wait = max(i for i in range(ring) if ops[i].what == "wait")  # the blocks' gather, prefetched
    ops.insert(wait, ops.pop(ring))
    simulate_step(lay, programs)


def test_a_message_of_another_size_is_refused():
    lay, programs = programs_of(cp=2)
    ops = programs[0]
    first = ops[0]
    ops[0] = replace(first, sends=((1, first.sends[0][1] + 8),))
    with pytest.raises(StepCommError, match=r"^rank 1 receives \d+ B float32 from rank 0 \(F mb 0 h\.0-3 ring step 0\) "
                                            r"but rank 0 sent \d+ B float32"):
        simulate_step(lay, programs)


def test_a_message_of_another_dtype_is_refused():
    lay, programs = programs_of(cp=2)
    programs[0][0] = replace(programs[0][0], dtype="float64")
    with pytest.raises(StepCommError, match=r"^rank 1 receives (\d+) B float32 from rank 0 \(F mb 0 h\.0-3 ring step 0\) "
                                            r"but rank 0 sent \1 B float64"):
        simulate_step(lay, programs)


def test_a_collective_of_another_dtype_is_refused():
    """The class of the int64 gradient-norm sum: the same bytes in another dtype on one rank."""
    lay, programs = programs_of(MOE, ep=2)
    programs[1][0] = replace(programs[1][0], dtype="float64")  # the expert counts, 32 B either way
    with pytest.raises(StepCommError, match=r"^ep group \[0, 1\], collective #0: rank 0 runs alltoall of 32 B int64 on "
                                            r"ep .*, rank 1 alltoall of 32 B float64 on ep"):
        simulate_step(lay, programs)


DEEP = load_model_config("tiny", {"n_layer": 16, "n_head": 8})


def large_layout() -> Layout:
    """16,384 ranks: dp 8 x pp 16 x cp 16 x tp 8, 16 micro-batches."""
    cfg = replace(TrainConfig(), tp=8, pp=16, cp=16, batch_size=8 * 16, seq_len=SEQ, microbatches=16)
    return Layout.of(cfg, Layout.resolve(cfg, 16384), DEEP)


def altered(monkeypatch, which, change) -> None:
    """Programs where ``change`` rewrites the first ring exchange of each rank ``which`` picks."""
    made = StepPrograms.program

    def program(self, rank):
        ops = made(self, rank)
        if which(self.layout, rank):
            first = next(i for i, op in enumerate(ops) if op.comm == "cp")
            ops[first] = change(ops[first])
        return ops

    monkeypatch.setattr(StepPrograms, "program", program)


def test_a_mismatch_on_a_far_rank_of_a_large_layout_is_found_by_that_rank(monkeypatch):
    """The last of 16,384 ranks sends its first ring message 8 B longer: that rank's own check (it
    runs its stage's program moved along dp and cp, or the proof does not hold) refuses the step,
    naming the rank and the operation; every rank's verdict reaches all through the start-up's
    error agreement."""
    lay = large_layout()
    far = proof_rank(lay, lay.world_size - 1)
    altered(monkeypatch, lambda small, rank: rank == far,
            lambda op: replace(op, sends=((op.sends[0][0], op.sends[0][1] + 8),)))
    check_step(lay, DEEP, "float32", rank=0)
    with pytest.raises(StepCommError, match=rf"^rank 16383 \(the proof's rank {far}\) does not run its pipeline "
                                            rf"stage's step program.*: operation #1: rank {far} runs send 4104 B float32 to "
                                            r"rank \d+, receive 4096 B float32 from rank \d+ on cp \(F mb 0 h\.15-15 ring step "
                                            r"0\), its stage's rank \d+ send 4096 B float32"):
        check_step(lay, DEEP, "float32", rank=lay.world_size - 1)


def test_a_mismatch_on_the_far_stage_of_a_large_layout_is_found_by_the_stages_simulation(monkeypatch):
    """Every rank of the last of 16 stages sends its first ring message 8 B longer than its ring
    peer receives: symmetric, so each rank's own check passes, and the simulation of one rank per
    stage finds the mismatch."""
    lay = large_layout()
    altered(monkeypatch, lambda small, rank: small.position(rank)["pp"] == small.pp - 1,
            lambda op: replace(op, sends=((op.sends[0][0], op.sends[0][1] + 8),)))
    with pytest.raises(StepCommError, match=r"^rank \d+ receives 4096 B float32 from rank \d+ \(F mb 0 h\.15-15 ring step "
                                            r"0\) but rank \d+ sent 4104 B float32"):
        check_step(lay, DEEP, "float32", rank=lay.world_size - 1)


def test_a_pipeline_message_under_sequence_parallelism_is_tps_piece_of_the_activations():
    """What ``python -m mpirt.verify`` found when it held the runtime's recorded calls to the
    programs: under SP a stage sends its tp piece of the sequence, not the whole of it."""
    for sp in (False, True):
        lay = layout_of(4, pp=2, tp=2, sequence_parallel=sp, microbatches=4)
        sends = {n for op in StepPrograms(lay, MODEL, "float64").program(0) if op.comm == "pp" for _, n in op.sends}
        assert sends == {lay.rows * SEQ // (2 if sp else 1) * MODEL.n_embd * 8}, (sp, sends)
