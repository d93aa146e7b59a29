"""The process grid: ``Grid(dp=, pp=, cp=, tp=)`` over the ranks of a communicator.

Ranks are laid out row-major over ``(dp, pp, cp, tp)``: tp innermost (tensor-parallel ranks are
neighbours, hence on one node), context parallelism next to it (its ring passes keys and values
every layer), then pp, dp outermost::

    rank = ((d * pp + p) * cp + c) * tp + t

Expert parallelism (``ep``) is carved out of dp, as Megatron does: the dp ranks ``d`` with the same
``d // ep`` form an *ep group* (consecutive dp ranks, each holding ``1/ep`` of every MoE layer's
experts; tokens travel between them by all-to-all), those with the same ``d % ep`` an *edp group*
(the ranks holding the same experts, over which the experts' gradients are reduced). ``ep = 1``
is plain dp.

The coordinate math is pure (``grid_coords``, ``grid_rank``, ``axis_groups``, ``check_layout``)
and needs no MPI; every function and :class:`Grid` take the axis sizes by keyword, in rank order
(``dp=, pp=, cp=, tp=``, each 1 when left out); :class:`Grid` builds the Cartesian communicator and one sub-communicator per
axis, and addresses collectives by axis name: ``grid.allreduce(x, "dp", op="avg")``. There is no
module-global state: pass the grid around.

``python -m mpirt.grid --dp 2 --pp 2 --cp 2 --tp 2`` prints the rank map without MPI (``--ep 2``
adds the expert groups).
"""
from __future__ import annotations

import argparse
import sys

AXES = ("dp", "pp", "cp", "tp")
# the ranks that hold the same parameters and different tokens: gradients are averaged over them
DATA_AXES = ("dp", "cp")


def _product(sizes: tuple) -> str:
    """``dp(2)*pp(2)*tp(2)``, cp named only when it splits anything (cp > 1)."""
    return "*".join(f"{a}({n})" for a, n in zip(AXES, sizes) if a != "cp" or n != 1)


def grid_coords(rank: int, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1) -> tuple[int, int, int, int]:
    """The (d, p, c, t) coordinates of ``rank`` (tp innermost, then cp, pp, dp outermost)."""
    sizes = dp, pp, cp, tp
    n = dp * pp * cp * tp
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a {_product(sizes)}={n} grid")
    coords = []
    for size in reversed(sizes):
        coords.append(rank % size)
        rank //= size
    return tuple(reversed(coords))


def grid_rank(coords, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1) -> int:
    """The rank at ``coords`` (d, p, c, t); the inverse of :func:`grid_coords`."""
    sizes = dp, pp, cp, tp
    if len(coords) != 4 or not all(0 <= c < n for c, n in zip(coords, sizes)):
        raise ValueError(f"coordinates {dict(zip(AXES, coords))} are outside a {_product(sizes)} grid")
    rank = 0
    for c, n in zip(coords, sizes):
        rank = rank * n + c
    return rank


def check_layout(*, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, world_size: int | None = None) -> None:
    """Refuse non-positive sizes, or a product that is not the world size, naming the product."""
    sizes = dp, pp, cp, tp
    for axis, n in zip(AXES, sizes):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{axis}: must be a positive integer, got {n!r}")
    total = dp * pp * cp * tp
    if world_size is not None and total != world_size:
        raise ValueError(f"{_product(sizes)}={total} != world size {world_size}")


def check_expert_layout(dp: int, ep: int) -> None:
    """Refuse an ep size that is not a positive integer dividing dp (ep groups are carved out of dp)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep: must be a positive integer, got {ep!r}")
    if dp % ep:
        raise ValueError(f"ep: {ep} does not divide dp={dp} (expert-parallel groups are carved out of the "
                         "data-parallel ranks)" + (f"; ep may be at most dp={dp}" if ep > dp else ""))


def expert_groups(dp: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(ep groups, edp groups)`` as lists of dp ranks: ep groups of ``ep`` consecutive dp ranks,
    edp groups of the dp ranks at the same place in their ep group."""
    check_expert_layout(dp, ep)
    return ([list(range(g * ep, (g + 1) * ep)) for g in range(dp // ep)],
            [list(range(e, dp, ep)) for e in range(ep)])


def resolve_dp(world_size: int, *, dp: int = 0, pp: int = 1, cp: int = 1, tp: int = 1) -> int:
    """``dp``, or when it is 0, the world size divided by pp*cp*tp (refused when not divisible)."""
    if dp == 0:
        check_layout(pp=pp, cp=cp, tp=tp)
        rest = pp * cp * tp
        if world_size % rest:
            raise ValueError(f"world size {world_size} is not divisible by "
                             f"{_product((1, pp, cp, tp)).removeprefix('dp(1)*')}={rest}")
        dp = world_size // rest
    check_layout(dp=dp, pp=pp, cp=cp, tp=tp, world_size=world_size)
    return dp


def axis_groups(axis: str, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1) -> list[list[int]]:
    """The ranks that communicate along ``axis`` (or the axes joined by ``_``, e.g. ``dp_cp``): one
    list per group, ordered by those coordinates (which is the rank inside the axis
    sub-communicator); groups in rank order."""
    picked = _axis_indices(axis)
    sizes = dp, pp, cp, tp
    groups: dict[tuple, list[int]] = {}
    for rank in range(dp * pp * cp * tp):
        c = grid_coords(rank, dp=dp, pp=pp, cp=cp, tp=tp)
        groups.setdefault(tuple(x for i, x in enumerate(c) if i not in picked), []).append(rank)
    width = 1
    for i in picked:
        width *= sizes[i]
    assert all(len(g) == width for g in groups.values())
    return sorted(groups.values())


def _axis_indices(axis: str) -> tuple[int, ...]:
    parts = axis.split("_")
    if not all(p in AXES for p in parts):
        raise ValueError(f"unknown grid axis {axis!r}: expected one of {', '.join(AXES)} (or dp_cp)")
    return tuple(AXES.index(p) for p in parts)


def format_rank_map(*, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1) -> str:
    """A table rank -> (dp, pp, cp, tp) and, per axis, the groups of ranks (cp left out when 1);
    with ep > 1 also the ep and edp groups of dp ranks."""
    check_layout(dp=dp, pp=pp, cp=cp, tp=tp)
    sizes = dp, pp, cp, tp
    shown = [i for i, a in enumerate(AXES) if a != "cp" or cp > 1]
    n = dp * pp * cp * tp
    w = max(4, len(str(n - 1)))
    lines = [f"grid {' x '.join(f'{AXES[i]}={sizes[i]}' for i in shown)} = {n} ranks (tp innermost)", "",
             f"{'rank':>{w}}  " + " ".join(f"{AXES[i]:>3}" for i in shown)]
    for rank in range(n):
        coords = grid_coords(rank, dp=dp, pp=pp, cp=cp, tp=tp)
        lines.append(f"{rank:>{w}}  " + " ".join(f"{coords[i]:>3}" for i in shown))
    lines.append("")
    for i in shown:
        groups = axis_groups(AXES[i], dp=dp, pp=pp, cp=cp, tp=tp)
        lines.append(f"{AXES[i]} groups ({len(groups)} x {len(groups[0])}): " + " ".join(map(str, groups)))
    if ep > 1:
        eps, edps = expert_groups(dp, ep)
        lines.append(f"ep groups of dp ranks ({len(eps)} x {ep}; experts split): " + " ".join(map(str, eps)))
        lines.append(f"edp groups of dp ranks ({len(edps)} x {dp // ep}; experts' gradients reduced): "
                     + " ".join(map(str, edps)))
    return "\n".join(lines)


class Grid:
    """The (dp, pp, cp, tp) process grid over ``comm`` (a :class:`mpirt.comm.Comm` or mpi4py
    communicator; default MPI_COMM_WORLD).

    - ``comm[axis]`` for axis in dp, pp, cp, tp, world: a :class:`~mpirt.comm.Comm` whose rank is
      the coordinate along that axis (``world`` is the Cartesian communicator, numbered like
      ``comm``); ``comm["dp_cp"]``: dp and cp together (:data:`DATA_AXES`: the ranks that hold the
      same parameters, over which gradients are averaged; rank ``d * cp + c``), ``comm["dp"]``
      itself when cp is 1; ``comm["ep"]`` and ``comm["edp"]``: this rank's ep and edp groups
      within dp (ep groups of ``ep`` consecutive dp ranks; ``comm["ep"]`` has one rank when ep is 1,
      ``comm["edp"]`` is dp itself).
    - ``rank``, ``coords`` and ``sizes`` (dicts keyed by axis, plus ``ep``: the size, and the place
      in the ep group), ``dp``, ``pp``, ``cp``, ``tp``, ``ep``.
    - ``prev_rank``/``next_rank``: the previous/next pipeline stage's rank in ``comm["world"]``,
      PROC_NULL at the ends; ``pp_prev``/``pp_next``: the same as ranks in ``comm["pp"]``.
    """

    def __init__(self, *, dp: int = 1, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, comm=None):
        from mpirt import comm as C

        if comm is None:
            comm = C.world_comm()
        parent = comm.mpi if isinstance(comm, C.Comm) else comm
        check_layout(dp=dp, pp=pp, cp=cp, tp=tp, world_size=parent.Get_size())
        check_expert_layout(dp, ep)
        self.dp, self.pp, self.cp, self.tp, self.ep = dp, pp, cp, tp, ep
        sizes = dp, pp, cp, tp
        cart = parent.Create_cart(list(sizes), periods=[False] * len(AXES), reorder=False)
        self.rank = cart.Get_rank()
        coords = tuple(cart.Get_coords(self.rank))
        assert coords == grid_coords(self.rank, dp=dp, pp=pp, cp=cp, tp=tp), (coords, self.rank)
        self.coords = dict(zip(AXES, coords))
        self.sizes = dict(zip(AXES, sizes))
        self.comm = {"world": C.Comm(cart, "world")}
        for i, axis in enumerate(AXES):
            self.comm[axis] = C.Comm(cart.Sub([j == i for j in range(len(AXES))]), axis)
        self.comm["dp_cp"] = self.comm["dp"] if cp == 1 else \
            C.Comm(cart.Sub([a in DATA_AXES for a in AXES]), "dp_cp")
        d, dp_mpi = self.coords["dp"], self.comm["dp"].mpi
        self.comm["ep"] = C.Comm(dp_mpi.Split(d // ep, d % ep), "ep")
        self.comm["edp"] = self.comm["dp"] if ep == 1 else C.Comm(dp_mpi.Split(d % ep, d // ep), "edp")
        self.sizes["ep"], self.coords["ep"] = ep, d % ep
        self.prev_rank, self.next_rank = cart.Shift(AXES.index("pp"), 1)
        p = self.coords["pp"]
        self.pp_prev = p - 1 if p > 0 else C.PROC_NULL
        self.pp_next = p + 1 if p < pp - 1 else C.PROC_NULL

    @classmethod
    def from_world(cls, *, dp: int = 0, pp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1, comm=None) -> "Grid":
        """A grid over ``comm`` (default the world) where ``dp=0`` means world size // (pp*cp*tp)."""
        from mpirt import comm as C

        if comm is None:
            comm = C.world_comm()
        size = comm.size if isinstance(comm, C.Comm) else comm.Get_size()
        return cls(dp=resolve_dp(size, dp=dp, pp=pp, cp=cp, tp=tp), pp=pp, cp=cp, tp=tp, ep=ep, comm=comm)

    def __repr__(self) -> str:
        return (f"Grid(dp={self.dp}, pp={self.pp}, cp={self.cp}, tp={self.tp}, ep={self.ep}, rank={self.rank}, "
                f"coords={self.coords})")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

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
            raise ValueError(f"unknown grid axis {axis!r}: expected one of {', '.join(self.comm)}") from None

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
        for c in {id(c): c for c in self.comm.values()}.values():  # dp_cp and edp may be dp itself
            c.free()
        self.comm = {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mpirt.grid", description="Print the rank map of a "
                                 "(dp, pp, cp, tp) grid (pure math: no MPI needed).")
    ap.add_argument("--dp", type=int, default=0, help="data-parallel size (0: world // (pp*cp*tp), needs --world)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (carved out of dp)")
    ap.add_argument("--world", type=int, default=None, help="world size to validate against")
    args = ap.parse_args(argv)
    try:
        if args.dp == 0 and args.world is None:
            raise ValueError("dp=0 (derive from the world size) needs --world")
        sizes = dict(pp=args.pp, cp=args.cp, tp=args.tp)
        dp = resolve_dp(args.world, dp=args.dp, **sizes) if args.world is not None else args.dp
        check_layout(dp=dp, **sizes)
        check_expert_layout(dp, args.ep)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_rank_map(dp=dp, pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep))
    return 0
