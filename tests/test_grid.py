"""mpirt.grid: the pure coordinate math (no MPI), the CLI, and the Grid's communicators under MPI."""
import itertools
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, agree
from mpirt.parallel.grid import (AXES, Grid, axis_groups, check_layout, expert_groups, grid_coords, grid_rank,
                                 resolve_dp)


def factorisations(n: int):
    """Every (dp, pp, cp, tp) whose product is n."""
    return [(dp, pp, cp, tp) for dp in range(1, n + 1) for pp in range(1, n + 1) for cp in range(1, n + 1)
            for tp in range(1, n + 1) if dp * pp * cp * tp == n]


LAYOUTS = factorisations(8) + factorisations(12)


# ------------------------------------------------------------------ pure math

@pytest.mark.parametrize("dp,pp,cp,tp", LAYOUTS)
def test_coords_are_a_bijection_with_tp_innermost_then_cp_and_dp_outermost(dp, pp, cp, tp):
    n = dp * pp * cp * tp
    coords = [grid_coords(r, dp=dp, pp=pp, cp=cp, tp=tp) for r in range(n)]
    # rank order is the lexicographic order of (dp, pp, cp, tp): tp varies fastest, dp slowest
    assert coords == list(itertools.product(range(dp), range(pp), range(cp), range(tp)))
    assert [grid_rank(c, dp=dp, pp=pp, cp=cp, tp=tp) for c in coords] == list(range(n))
    for r in range(n):
        assert coords[r][3] == r % tp and coords[r][2] == r // tp % cp  # TP, then CP ranks are neighbours


@pytest.mark.parametrize("dp,pp,cp,tp", LAYOUTS)
def test_axis_groups_partition_the_ranks_along_one_coordinate(dp, pp, cp, tp):
    sizes = dict(zip(AXES, (dp, pp, cp, tp)))
    n = dp * pp * cp * tp
    for i, axis in enumerate(AXES):
        groups = axis_groups(axis, dp=dp, pp=pp, cp=cp, tp=tp)
        assert sorted(r for g in groups for r in g) == list(range(n))
        assert len(groups) == n // sizes[axis] and all(len(g) == sizes[axis] for g in groups)
        for g in groups:
            cs = [grid_coords(r, dp=dp, pp=pp, cp=cp, tp=tp) for r in g]
            assert [c[i] for c in cs] == list(range(sizes[axis]))  # ordered by the axis coordinate
            assert len({c[:i] + c[i + 1:] for c in cs}) == 1       # the other coordinates agree
    if tp > 1:
        assert axis_groups("tp", dp=dp, pp=pp, cp=cp, tp=tp)[0] == list(range(tp))
    # dp and cp together: the ranks that hold the same parameters, ordered d * cp + c
    for g in axis_groups("dp_cp", dp=dp, pp=pp, cp=cp, tp=tp):
        cs = [grid_coords(r, dp=dp, pp=pp, cp=cp, tp=tp) for r in g]
        assert [(c[0], c[2]) for c in cs] == list(itertools.product(range(dp), range(cp)))
        assert len({(c[1], c[3]) for c in cs}) == 1


def test_known_groups_of_2x2x2_and_of_a_context_parallel_grid():
    assert axis_groups("dp", dp=2, pp=2, tp=2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert axis_groups("pp", dp=2, pp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups("tp", dp=2, pp=2, tp=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid_coords(5, dp=2, pp=2, tp=2) == (1, 0, 0, 1)
    assert axis_groups("cp", dp=2, pp=1, cp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups("dp_cp", dp=2, pp=1, cp=2, tp=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid_coords(6, dp=2, pp=1, cp=2, tp=2) == (1, 0, 1, 0)


def test_validation_names_the_failing_product():
    with pytest.raises(ValueError, match=r"^dp\(2\)\*pp\(2\)\*tp\(3\)=12 != world size 8$"):
        check_layout(dp=2, pp=2, tp=3, world_size=8)
    with pytest.raises(ValueError, match="tp: must be a positive integer, got 0"):
        check_layout(dp=2, pp=2, tp=0)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by pp\(3\)\*tp\(1\)=3"):
        resolve_dp(8, dp=0, pp=3, tp=1)
    with pytest.raises(ValueError, match="outside"):
        grid_coords(8, dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match="unknown grid axis 'ep'"):
        axis_groups("ep", dp=2, pp=2, tp=2)
    with pytest.raises(ValueError, match=r"^dp\(2\)\*pp\(1\)\*cp\(2\)\*tp\(3\)=12 != world size 8$"):
        check_layout(dp=2, pp=1, cp=2, tp=3, world_size=8)
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by pp\(1\)\*cp\(3\)\*tp\(1\)=3"):
        resolve_dp(8, dp=0, pp=1, cp=3, tp=1)
    assert resolve_dp(8, dp=0, pp=2, tp=2) == 2 and resolve_dp(12, dp=0, pp=1, tp=3) == 4 and resolve_dp(8, dp=8) == 8
    assert resolve_dp(8, dp=0, pp=1, cp=2, tp=2) == 2


def _cli(*args):
    code = ("import sys; from mpirt.parallel.grid import main; rc = main(sys.argv[1:]); "
            "assert 'mpi4py' not in sys.modules, 'the CLI imported mpi4py'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_cli_prints_the_rank_map_without_mpi():
    r = _cli("--dp", "2", "--pp", "2", "--tp", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "grid dp=2 x pp=2 x tp=2 = 8 ranks (tp innermost)" in lines
    assert [line.split() for line in lines if line.strip().startswith("5 ")] == [["5", "1", "0", "1"]]
    assert "tp groups (4 x 2): [0, 1] [2, 3] [4, 5] [6, 7]" in lines
    assert "dp groups (4 x 2): [0, 4] [1, 5] [2, 6] [3, 7]" in lines
    r = _cli("--pp", "2", "--world", "8")
    assert r.returncode == 0 and "grid dp=4 x pp=2 x tp=1 = 8 ranks" in r.stdout
    r = _cli("--dp", "2", "--pp", "2", "--tp", "3", "--world", "8")
    assert r.returncode == 2 and "dp(2)*pp(2)*tp(3)=12 != world size 8" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mpirt.grid", "--dp", "1", "--tp", "2"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "tp groups (1 x 2): [0, 1]" in r.stdout
    r = _cli("--cp", "2", "--tp", "2", "--world", "8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "grid dp=2 x pp=1 x cp=2 x tp=2 = 8 ranks (tp innermost)" in lines
    assert [line.split() for line in lines if line.strip().startswith("6 ")] == [["6", "1", "0", "1", "0"]]
    assert "cp groups (4 x 2): [0, 2] [1, 3] [4, 6] [5, 7]" in lines


# ------------------------------------------------------------------ under MPI

def _check_grid(grid: Grid, fails: list) -> None:
    """Membership, coordinates, neighbours and axis collectives of ``grid`` against the pure math."""
    from mpi4py import MPI
    from mpirt.comm import PROC_NULL
    rank, (dp, pp, cp, tp) = MPI.COMM_WORLD.rank, (grid.dp, grid.pp, grid.cp, grid.tp)
    name = f"{dp}x{pp}x{cp}x{tp}"
    d, p, k, t = grid_coords(rank, dp=dp, pp=pp, cp=cp, tp=tp)
    if grid.rank != rank or grid.coords != {"dp": d, "pp": p, "cp": k, "tp": t, "ep": 0}:
        fails.append(f"{name}: rank/coords {grid.rank} {grid.coords}")
    for axis in (*AXES, "dp_cp"):
        c = grid.comm[axis]
        group = next(g for g in axis_groups(axis, dp=dp, pp=pp, cp=cp, tp=tp) if rank in g)
        members = c.allgather(np.array([rank])).tolist()
        want_rank = d * cp + k if axis == "dp_cp" else grid.coords[axis]
        want_size = dp * cp if axis == "dp_cp" else grid.sizes[axis]
        if members != group or c.rank != want_rank or c.size != want_size or c.axis != ("dp" if axis == "dp_cp" and cp == 1 else axis):
            fails.append(f"{name} {axis}: members {members} != {group}")
        total = grid.allreduce(np.array([rank], np.int64), axis).item()
        avg = grid.allreduce(np.array([float(rank)]), axis, op="avg").item()
        root = grid.broadcast(np.array([rank]), axis, root=len(group) - 1).item()
        if (total, avg, root) != (sum(group), sum(group) / len(group), group[-1]):
            fails.append(f"{name} {axis}: allreduce/avg/broadcast {total} {avg} {root}")
        x = np.arange(10.0) + rank  # reduce_scatter + allgather_flat over the axis = allreduce
        full = grid.allgather_flat(grid.reduce_scatter(x, axis), 10, axis)
        if not np.array_equal(full, np.arange(10.0) * len(group) + sum(group)):
            fails.append(f"{name} {axis}: reduce_scatter/allgather_flat")
        if not np.array_equal(grid.allgather(np.array([[rank]]), axis).ravel(), group):
            fails.append(f"{name} {axis}: allgather")
    prev = grid_rank((d, p - 1, k, t), dp=dp, pp=pp, cp=cp, tp=tp) if p > 0 else PROC_NULL
    nxt = grid_rank((d, p + 1, k, t), dp=dp, pp=pp, cp=cp, tp=tp) if p < pp - 1 else PROC_NULL
    pp_prev, pp_next = (p - 1 if p > 0 else PROC_NULL), (p + 1 if p < pp - 1 else PROC_NULL)
    if (grid.prev_rank, grid.next_rank, grid.pp_prev, grid.pp_next) != (prev, nxt, pp_prev, pp_next):
        fails.append(f"{name}: neighbours {grid.prev_rank} {grid.next_rank} {grid.pp_prev} {grid.pp_next}")
    if (grid.is_first_stage, grid.is_last_stage) != (p == 0, p == pp - 1):
        fails.append(f"{name}: first/last stage")
    # pipeline hand-off: each stage sends its rank forward, the first stage receives nothing
    got = np.array([-1])
    world, ppc = grid.comm["world"], grid.comm["pp"]
    handles = [world.irecv(got, grid.prev_rank, tag=11), world.isend(np.array([rank]), grid.next_rank, tag=11)]
    for h in handles:
        h.wait()
    got2 = np.array([-1])
    handles = [ppc.irecv(got2, grid.pp_prev, tag=12), ppc.isend(np.array([rank]), grid.pp_next, tag=12)]
    for h in handles:
        h.wait()
    want = -1 if prev == PROC_NULL else prev
    if got.item() != want or got2.item() != want:
        fails.append(f"{name}: pipeline hand-off got {got.item()} {got2.item()}, want {want}")


@pytest.mark.mpi(min_size=2)
def test_grid_data_parallel_only_at_any_size():
    fails = []
    grid = Grid.from_world()
    _check_grid(grid, fails)
    grid.free()
    agree(not fails, fails)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pp,tp", [(1, 2), (2, 2), (2, 1), (1, 1), (4, 1), (1, 4), (2, 4)])
def test_grid_sub_communicators_neighbours_and_collectives(pp, tp):
    from mpi4py import MPI
    if MPI.COMM_WORLD.size % (pp * tp):
        pytest.skip(f"world size {MPI.COMM_WORLD.size} is not divisible by pp*tp={pp * tp}")
    fails = []
    grid = Grid.from_world(pp=pp, tp=tp)
    _check_grid(grid, fails)
    grid.free()
    agree(not fails, fails)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pp,cp,tp", [(1, 2, 1), (1, 2, 2), (2, 2, 1), (1, 4, 1), (2, 2, 2)])
def test_grid_with_context_parallelism(pp, cp, tp):
    from mpi4py import MPI
    if MPI.COMM_WORLD.size % (pp * cp * tp):
        pytest.skip(f"world size {MPI.COMM_WORLD.size} is not divisible by pp*cp*tp={pp * cp * tp}")
    fails = []
    grid = Grid.from_world(pp=pp, tp=tp, cp=cp)
    _check_grid(grid, fails)
    grid.free()
    agree(not fails, fails)


def test_expert_groups_are_consecutive_dp_ranks_and_their_strides():
    assert expert_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_groups(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert expert_groups(2, 1) == ([[0], [1]], [[0, 1]])
    for dp, ep, message in [(2, 4, "ep: 4 does not divide dp=2 (expert-parallel groups are carved out of the "
                                   "data-parallel ranks); ep may be at most dp=2"),
                            (4, 3, "ep: 3 does not divide dp=4"), (4, 0, "ep: must be a positive integer, got 0")]:
        with pytest.raises(ValueError) as err:
            expert_groups(dp, ep)
        assert str(err.value).startswith(message)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("ep,tp", [(2, 1), (4, 1), (2, 2)])
def test_grid_expert_groups_split_dp(ep, tp):
    """comm["ep"] holds ep consecutive dp ranks, comm["edp"] the dp ranks at the same place in theirs;
    an allgather over each returns exactly those dp coordinates."""
    from mpi4py import MPI
    if MPI.COMM_WORLD.size % (ep * tp):
        pytest.skip(f"world size {MPI.COMM_WORLD.size} is not divisible by ep*tp={ep * tp}")
    grid = Grid.from_world(tp=tp, ep=ep)
    d = grid.coords["dp"]
    eps, edps = expert_groups(grid.dp, ep)
    fails = []
    for axis, groups in (("ep", eps), ("edp", edps)):
        got = grid.comm[axis].allgather(np.array([d]), counts=[1] * grid.comm[axis].size).tolist()
        want = next(g for g in groups if d in g)
        if got != want:
            fails.append(f"rank {grid.rank}: {axis} group {got}, want {want}")
    if grid.coords["ep"] != d % ep or grid.sizes["ep"] != ep:
        fails.append(f"rank {grid.rank}: ep coordinate {grid.coords['ep']}")
    grid.free()
    agree(not fails, fails)


@pytest.mark.mpi(min_size=4)
def test_grid_refuses_a_layout_that_does_not_fill_the_world():
    from mpi4py import MPI
    size = MPI.COMM_WORLD.size
    fails = []
    try:
        Grid(dp=3, pp=1, tp=size)
        fails.append("accepted")
    except ValueError as err:
        if str(err) != f"dp(3)*pp(1)*tp({size})={3 * size} != world size {size}":
            fails.append(str(err))
    agree(not fails, fails)
