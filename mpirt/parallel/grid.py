"""The process grid: ``Grid(dp, pp, tp)`` over the ranks of a communicator.

Ranks are laid out row-major over ``(dp, pp, tp)``: tp innermost (tensor-parallel ranks are
neighbours, hence on one node), then pp, dp outermost::

    rank = (d * pp + p) * tp + t

The coordinate math is pure (``grid_coords``, ``grid_rank``, ``axis_groups``, ``check_layout``)
and needs no MPI; :class:`Grid` builds the Cartesian communicator and one sub-communicator per
axis, and addresses collectives by axis name: ``grid.allreduce(x, "dp", op="avg")``. There is no
module-global state: pass the grid around.

``python -m mpirt.grid --dp 2 --pp 2 --tp 2`` prints the rank map without MPI.
"""
from __future__ import annotations

import argparse
import sys

AXES = ("dp", "pp", "tp")


def grid_coords(rank: int, dp: int, pp: int, tp: int) -> tuple[int, int, int]:
    """The (d, p, t) coordinates of ``rank`` (tp innermost, dp outermost)."""
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} is outside a dp({dp})*pp({pp})*tp({tp})={dp * pp * tp} grid")
    return rank // (pp * tp), rank // tp % pp, rank % tp


def grid_rank(d: int, p: int, t: int, dp: int, pp: int, tp: int) -> int:
    """The rank at coordinates (d, p, t); the inverse of :func:`grid_coords`."""
    if not (0 <= d < dp and 0 <= p < pp and 0 <= t < tp):
        raise ValueError(f"coordinates (dp={d}, pp={p}, tp={t}) are outside a dp({dp})*pp({pp})*tp({tp}) grid")
    return (d * pp + p) * tp + t


def check_layout(dp: int, pp: int, tp: int, world_size: int | None = None) -> None:
    """Refuse non-positive sizes, or a product that is not the world size, naming the product."""
    for axis, n in zip(AXES, (dp, pp, tp)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{axis}: must be a positive integer, got {n!r}")
    if world_size is not None and dp * pp * tp != world_size:
        raise ValueError(f"dp({dp})*pp({pp})*tp({tp})={dp * pp * tp} != world size {world_size}")


def resolve_dp(world_size: int, dp: int = 0, pp: int = 1, tp: int = 1) -> int:
    """``dp``, or when it is 0, the world size divided by pp*tp (refused when not divisible)."""
    if dp == 0:
        check_layout(1, pp, tp)
        if world_size % (pp * tp):
            raise ValueError(f"world size {world_size} is not divisible by pp({pp})*tp({tp})={pp * tp}")
        dp = world_size // (pp * tp)
    check_layout(dp, pp, tp, world_size)
    return dp


def axis_groups(axis: str, dp: int, pp: int, tp: int) -> list[list[int]]:
    """The ranks that communicate along ``axis``: one list per group, ordered by that axis's
    coordinate (which is the rank inside the axis sub-communicator); groups in rank order."""
    i = _axis_index(axis)
    sizes = (dp, pp, tp)
    groups: dict[tuple, list[int]] = {}
    for rank in range(dp * pp * tp):
        c = grid_coords(rank, dp, pp, tp)
        groups.setdefault(c[:i] + c[i + 1:], []).append(rank)
    assert all(len(g) == sizes[i] for g in groups.values())
    return sorted(groups.values())


def _axis_index(axis: str) -> int:
    if axis not in AXES:
        raise ValueError(f"unknown grid axis {axis!r}: expected one of {', '.join(AXES)}")
    return AXES.index(axis)


def format_rank_map(dp: int, pp: int, tp: int) -> str:
    """A table rank -> (dp, pp, tp) and, per axis, the groups of ranks."""
    check_layout(dp, pp, tp)
    n = dp * pp * tp
    w = max(4, len(str(n - 1)))
    lines = [f"grid dp={dp} x pp={pp} x tp={tp} = {n} ranks (tp innermost)", "",
             f"{'rank':>{w}}  {'dp':>3} {'pp':>3} {'tp':>3}"]
    for rank in range(n):
        d, p, t = grid_coords(rank, dp, pp, tp)
        lines.append(f"{rank:>{w}}  {d:>3} {p:>3} {t:>3}")
    lines.append("")
    for axis in AXES:
        groups = axis_groups(axis, dp, pp, tp)
        lines.append(f"{axis} groups ({len(groups)} x {len(groups[0])}): " + " ".join(map(str, groups)))
    return "\n".join(lines)


class Grid:
    """The (dp, pp, tp) process grid over ``comm`` (a :class:`mpirt.comm.Comm` or mpi4py
    communicator; default MPI_COMM_WORLD).

    - ``comm[axis]`` for axis in dp, pp, tp, world: a :class:`~mpirt.comm.Comm` whose rank is the
      coordinate along that axis (``world`` is the Cartesian communicator, numbered like ``comm``).
    - ``rank``, ``coords`` and ``sizes`` (dicts keyed by axis), ``dp``, ``pp``, ``tp``.
    - ``prev_rank``/``next_rank``: the previous/next pipeline stage's rank in ``comm["world"]``,
      PROC_NULL at the ends; ``pp_prev``/``pp_next``: the same as ranks in ``comm["pp"]``.
    """

    def __init__(self, dp: int, pp: int, tp: int, comm=None):
        from mpirt import comm as C

        if comm is None:
            comm = C.world_comm()
        parent = comm.mpi if isinstance(comm, C.Comm) else comm
        check_layout(dp, pp, tp, parent.Get_size())
        self.dp, self.pp, self.tp = dp, pp, tp
        cart = parent.Create_cart([dp, pp, tp], periods=[False] * 3, reorder=False)
        self.rank = cart.Get_rank()
        coords = tuple(cart.Get_coords(self.rank))
        assert coords == grid_coords(self.rank, dp, pp, tp), (coords, self.rank)
        self.coords = dict(zip(AXES, coords))
        self.sizes = dict(zip(AXES, (dp, pp, tp)))
        self.comm = {"world": C.Comm(cart, "world")}
        for i, axis in enumerate(AXES):
            self.comm[axis] = C.Comm(cart.Sub([j == i for j in range(3)]), axis)
        self.prev_rank, self.next_rank = cart.Shift(1, 1)
        p = self.coords["pp"]
        self.pp_prev = p - 1 if p > 0 else C.PROC_NULL
        self.pp_next = p + 1 if p < pp - 1 else C.PROC_NULL

    @classmethod
    def from_world(cls, dp: int = 0, pp: int = 1, tp: int = 1, comm=None) -> "Grid":
        """A grid over ``comm`` (default the world) where ``dp=0`` means world size // (pp*tp)."""
        from mpirt import comm as C

        if comm is None:
            comm = C.world_comm()
        size = comm.size if isinstance(comm, C.Comm) else comm.Get_size()
        return cls(resolve_dp(size, dp, pp, tp), pp, tp, comm)

    def __repr__(self) -> str:
        return f"Grid(dp={self.dp}, pp={self.pp}, tp={self.tp}, rank={self.rank}, coords={self.coords})"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.pp - 1

    def _c(self, axis: str):
        try:
            return self.comm[axis]
        except KeyError:
            raise ValueError(f"unknown grid axis {axis!r}: expected one of dp, pp, tp, world") from None

    def allreduce(self, x, axis: str, op: str = "sum", out=None):
        return self._c(axis).allreduce(x, op=op, out=out)

    def iallreduce(self, x, axis: str, op: str = "sum"):
        return self._c(axis).iallreduce(x, op=op)

    def broadcast(self, x, axis: str, root: int = 0):
        return self._c(axis).broadcast(x, root=root)

    def reduce_scatter(self, x, axis: str, op: str = "sum", out=None):
        return self._c(axis).reduce_scatter(x, op=op, out=out)

    def allgather(self, x, axis: str, counts=None, out=None):
        return self._c(axis).allgather(x, counts=counts, out=out)

    def allgather_flat(self, chunk, n: int, axis: str, out=None):
        return self._c(axis).allgather_flat(chunk, n, out=out)

    def barrier(self, axis: str = "world") -> None:
        self._c(axis).barrier()

    def free(self) -> None:
        """Release the sub-communicators and the Cartesian communicator."""
        for c in self.comm.values():
            c.free()
        self.comm = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpirt.grid", description="Print the rank map of a "
                                 "(dp, pp, tp) grid (pure math: no MPI needed).")
    ap.add_argument("--dp", type=int, default=0, help="data-parallel size (0: world // (pp*tp), needs --world)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--world", type=int, default=None, help="world size to validate against")
    args = ap.parse_args(argv)
    try:
        if args.dp == 0 and args.world is None:
            raise ValueError("dp=0 (derive from the world size) needs --world")
        dp = resolve_dp(args.world, args.dp, args.pp, args.tp) if args.world is not None else args.dp
        check_layout(dp, args.pp, args.tp)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_rank_map(dp, args.pp, args.tp))
    return 0
