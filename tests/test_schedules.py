"""Pipeline schedules as data (mpirt.parallel.pipeline.schedules, mpirt.parallel.pipeline.check):
generators, the pre-flight deadlock proof, the performance model and the ``python -m
mpirt.schedule`` command line. Pure: no MPI."""
import dataclasses

import pytest

from mpirt.run import schedule as cli
from mpirt.parallel.pipeline.check import check, format_timeline, simulate, theoretical_bubble, timed
from mpirt.parallel.pipeline.schedules import (BACKWARD as B, FORWARD as F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD,
                                              WEIGHT as W, Action, Schedule, ScheduleError, build)

GRID = [(name, p, m, v)
        for name in ("gpipe", "1f1b", "zb-h1", "interleaved")
        for p in (1, 2, 3, 4, 6)
        for m in (1, 2, 3, 4, 5, 6, 8, 12)
        for v in ((2, 3, 4) if name == "interleaved" else (1,))]


def refused(name, p, m, v) -> bool:
    return name == "interleaved" and (p < 2 or m % p != 0)


def edited(s: Schedule, rank: int, fn) -> Schedule:
    """A copy of ``s`` with rank ``rank``'s action list replaced by ``fn(list)``."""
    actions = [list(a) for a in s.actions]
    actions[rank] = fn(actions[rank])
    return dataclasses.replace(s, actions=actions)


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_generated_schedules_pass_the_check(name, p, m, v):
    if refused(name, p, m, v):
        with pytest.raises(ScheduleError, match="interleaved 1F1B needs"):
            build(name, p, m, v)
        return
    s = build(name, p, m, v)
    r = check(s)  # raises on any problem
    assert r.ok and not r.errors
    # every (mb, chunk) is forwarded and backwarded exactly once on every rank
    for rank in range(p):
        ops = [(a.op, a.mb, a.chunk) for a in s.compute(rank)]
        assert sorted(ops) == sorted((op, i, c) for op in ((F, B, W) if s.split_backward else (F, B))
                                     for i in range(m) for c in range(v))
    # one message per link crossing, each way: 2 (S - 1) m
    assert r.messages == 2 * (p * v - 1) * m
    if m >= p:  # the simulated bubble is the textbook one, at unit costs
        assert r.bubble == pytest.approx(theoretical_bubble(name, p, m, v), abs=1e-12)


@pytest.mark.parametrize("name,p,m,v", [g for g in GRID if not refused(*g) and g[1] > 1][::3])
def test_timed_program_gives_the_simulated_times(name, p, m, v):
    """The performance model's flattened replay (proved once, then timed) against the full
    simulation, with costs that differ per rank, op and chunk and a message latency."""
    s = build(name, p, m, v)
    def cost(r, op, chunk):
        return 1.0 + 0.37 * r + {F: 0.5, B: 1.1, W: 0.7}[op] * (1 + chunk)
    want = simulate(s, lambda r, a: cost(r, a.op, a.chunk), latency=0.3)
    got = timed(s, cost, latency=0.3)
    assert got.ok and got.makespan == pytest.approx(want.makespan, rel=1e-12)
    assert got.busy == pytest.approx(want.busy, rel=1e-12) and got.bubble == pytest.approx(want.bubble, rel=1e-12)


def test_timed_refuses_a_schedule_that_fails_the_proof():
    s = build("1f1b", 2, 4)
    broken = edited(s, 1, lambda acts: [a for a in acts if a.op != RECV_ACT])
    with pytest.raises(ScheduleError, match="recv act"):
        timed(broken, lambda r, op, chunk: 1.0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (4, 2), (6, 12)])
def test_peak_stashed_activations(p, m):
    gpipe, f1b, zb = (simulate(build(n, p, m)).peak_stash for n in ("gpipe", "1f1b", "zb-h1"))
    assert gpipe == [m] * p
    assert f1b == [min(p - r, m) for r in range(p)]
    # ZB-H1 keeps 1F1B's peak (its first stage's) on every stage: never more than 1F1B's peak
    assert max(zb) <= max(f1b) and zb[0] == f1b[0]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_is_a_third_of_1f1b(p, m):
    c = {F: 1, B: 1, W: 1}
    zb, f1b = simulate(build("zb-h1", p, m), c), simulate(build("1f1b", p, m), {F: 1, B: 2, W: 0})
    assert zb.makespan == 3 * m + (p - 1) and f1b.makespan == 3 * (m + p - 1)
    assert sum(zb.idle) * 3 == sum(f1b.idle)


def test_interleaving_divides_the_bubble():
    p, m = 4, 8
    b1 = simulate(build("1f1b", p, m)).bubble
    for v in (2, 4):
        r = simulate(build("interleaved", p, m, v))
        assert r.bubble == pytest.approx((p - 1) / (v * m + p - 1)) and r.bubble < b1


def test_refusals_are_clear():
    with pytest.raises(ScheduleError, match="multiple of pp: microbatches=6, pp=4 .use 4 or 8"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="chunks >= 2"):
        build("interleaved", 4, 8, 1)
    with pytest.raises(ScheduleError, match="only the interleaved schedule"):
        build("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="unknown 'pipedream'"):
        build("pipedream", 4, 8)
    with pytest.raises(ScheduleError, match="microbatches: must be a positive integer"):
        build("1f1b", 4, 0)


# --- the checker rejects broken schedules, naming the rank and the action ----------------------
def test_swapped_send_and_recv_deadlock():
    s = build("1f1b", 2, 4)

    def swap(acts):  # rank 0 waits for mb 0's gradient before sending mb 0's activation
        i = acts.index(Action(SEND_ACT, 0, 0, 1))
        j = acts.index(Action(RECV_GRAD, 0, 0, 1))
        acts.insert(i, acts.pop(j))
        return acts

    r = simulate(edited(s, 0, swap))
    assert not r.ok
    text = "\n".join(r.errors)
    assert "rank 0: recv grad mb=0 from rank 1, deadlock: rank 1 would send it" in text
    assert "rank 1: recv act mb=0 from rank 0, deadlock: rank 0 would send it (send act mb=0 to rank 1) " \
           "only after its own blocked action recv grad mb=0 from rank 1" in text
    with pytest.raises(ScheduleError, match="fails the pre-flight check"):
        check(edited(s, 0, swap))


def test_missing_send_is_never_sent():
    s = build("1f1b", 4, 8)
    r = simulate(edited(s, 3, lambda acts: [a for a in acts if a != Action(SEND_GRAD, 5, 0, 2)]))
    assert not r.ok
    text = "\n".join(r.errors)
    # matched FIFO, rank 2's receive for mb 5 gets mb 6's gradient, and its last receive waits forever
    assert "rank 2: recv grad mb=5 from rank 3 receives rank 3's message send grad mb=6 to rank 2" in text
    assert "rank 2: recv grad mb=7 from rank 3, never sent (blocked at action 45 of 48)" in text
    assert any("rank 3: mb=5: B's input gradient has no send grad after it" in e for e in r.errors)


def test_missing_receive_is_reported():
    s = build("1f1b", 4, 8)
    r = simulate(edited(s, 1, lambda acts: [a for a in acts if a != Action(RECV_GRAD, 5, 0, 2)]))
    assert not r.ok
    text = "\n".join(r.errors)
    assert "rank 1: mb=5: B runs without a recv grad before it" in text
    # FIFO matching: rank 1's next gradient receive gets the message meant for the missing one
    assert "rank 1: recv grad mb=6 from rank 2 receives rank 2's message send grad mb=5 to rank 1" in text
    assert "never received" in text


def test_swapped_receives_break_fifo_matching():
    s = build("gpipe", 2, 4)

    def swap(acts):
        i, j = acts.index(Action(RECV_ACT, 0, 0, 0)), acts.index(Action(RECV_ACT, 1, 0, 0))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    r = simulate(edited(s, 1, swap))
    assert not r.ok
    assert any(e.startswith("rank 1: recv act mb=1 from rank 0 receives rank 0's message send act mb=0")
               for e in r.errors), r.errors


def test_wrong_peer_and_missing_w():
    s = build("zb-h1", 2, 4)
    r = simulate(edited(s, 0, lambda acts: [dataclasses.replace(a, peer=0) if a.op == SEND_ACT and a.mb == 2 else a
                                            for a in acts if a != Action(W, 3)]))
    assert not r.ok
    text = "\n".join(r.errors)
    assert "rank 0: send act mb=2 to rank 0: wrong peer (the neighbour is rank 1)" in text
    assert "rank 0: mb=3: split backward but no W" in text


# --- timeline and command line ---------------------------------------------------------------
def test_timeline_text():
    r = simulate(build("1f1b", 2, 3))
    text = format_timeline(r)
    rows = text.splitlines()
    assert len(rows) == 2 and rows[0].startswith("rank 0 | F0 F1 .") and rows[1].startswith("rank 1 | .  F0 B0")
    assert all(len(row.split("|")[1].split()) <= int(r.makespan) for row in rows)
    inter = format_timeline(simulate(build("interleaved", 2, 2, 2)))
    assert "F0.1" in inter and "B1.0" in inter


def test_cli_prints_timeline_and_verdict(capsys):
    assert cli.main(["--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "rank 3 | .  .  .  F0 B0 B0 F1" in out
    assert "check: OK: 48 messages, every send has its receive, no deadlock" in out
    assert "bubble: 27.3% simulated, 27.3% in theory" in out
    assert cli.main(["--pp", "4", "--microbatches", "8", "--schedule", "interleaved", "--chunks", "2"]) == 0
    assert "F0.1" in capsys.readouterr().out
    assert cli.main(["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"]) == 0
    assert "W7" in capsys.readouterr().out
    assert cli.main(["--pp", "4", "--microbatches", "6", "--schedule", "interleaved"]) == 2
    assert "multiple of pp" in capsys.readouterr().err


# ------------------------------------------------------------- one set of names everywhere

def test_schedule_names_agree_between_cli_and_train_config(capsys):
    """Every spelling ``python -m mpirt.schedule`` accepts, ``mpirt.train --schedule`` accepts too
    (and the other way round), both mapping it to the same canonical name; unknown names are
    refused by both."""
    from mpirt.run.config import ConfigError, parse_args
    from mpirt.parallel.pipeline.schedules import ALIASES, SCHEDULES, canonical_name

    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert set(ALIASES.values()) <= set(SCHEDULES) and not set(ALIASES) & set(SCHEDULES)
    known = list(SCHEDULES) + list(ALIASES)
    candidates = known + [n.upper() for n in known] + ["zb-h2", "pipedream", "1F1B-interleaved", "", "gpipe "]
    for name in candidates:
        cli_rc = cli.main(["--pp", "4", "--microbatches", "8", "--schedule", name])
        err = capsys.readouterr().err
        assert cli_rc in (0, 2), (name, cli_rc, err)
        cli_ok = cli_rc == 0
        try:
            cfg = parse_args(["--schedule", name])
            train_ok = True
        except ConfigError as exc:
            train_ok = False
            assert str(exc).startswith("schedule:"), exc
        assert cli_ok == train_ok == (name.lower() in known), name
        if train_ok:
            assert cfg.schedule == canonical_name(name) in SCHEDULES, name
        else:
            assert "unknown" in err and ", ".join(SCHEDULES) in err, err
    # the help texts of both entry points list the canonical names
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert ", ".join(SCHEDULES) in out
    from mpirt.run.config import help_text
    assert "|".join(SCHEDULES) in help_text()
