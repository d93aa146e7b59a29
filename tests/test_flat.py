"""The parameter store's arithmetic (mpirt.parallel.flat) and the flat boxes of sharded checkpoints
(mpirt.parallel.shards), single process: every offset, view, dp chunk, segment, bucket and run of
:class:`FlatLayout`, and every box of a ZeRO segment of a tp slice, held against the elements they
must name, computed here independently (numpy concatenation of ravelled arrays, hand-built shards)."""
import itertools
import math

import numpy as np
import pytest

from mpirt.core.nn import Parameter, ShardSpec
from mpirt.parallel.flat import (FlatLayout, FlatParams, ShardedLayout, clip_flat, count_once, place_shards,
                                 sum_squares, trainable)
from mpirt.parallel.shards import _boxes, _flat_boxes, _runs
from mpirt.parallel.tensor.axis import PaddedParameter, pad_vocab

SHAPES = [(3,), (2, 5), (0,), (1,), (3, 1, 2), (7,), (0, 4), (4, 3)]  # 1-D, 2-D, 3-D, zero-size, odd


def make_params(shapes, dtype="float64"):
    """Named parameters of ``shapes`` holding distinct values (``arange`` offsets), and their arrays."""
    params, arrays, n = [], [], 0
    for i, s in enumerate(shapes):
        a = np.arange(n, n + math.prod(s), dtype=dtype).reshape(s) + 1
        n += a.size
        p = Parameter(s, dtype=dtype)
        p.data, p.name = a.copy(), f"p{i}"
        params.append(p)
        arrays.append(a)
    return params, arrays


def flat_of(arrays):
    return np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0)


def true_runs(mask):
    """Maximal ``[start, stop)`` runs of True in a boolean vector."""
    out, start = [], None
    for i, v in enumerate(list(mask) + [False]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


# --- FlatLayout ----------------------------------------------------------------------------------
def test_offsets_are_back_to_back_and_numel_is_the_total():
    """Offsets start at 0, follow each other without gaps and span each parameter's size; numel is their sum."""
    params, arrays = make_params(SHAPES)
    layout = FlatLayout(params)
    assert layout.shapes == [tuple(s) for s in SHAPES]
    assert layout.numel == sum(a.size for a in arrays)
    pos = 0
    for (a, b), arr in zip(layout.offsets, arrays):
        assert (a, b) == (pos, pos + arr.size)
        pos = b


def test_shapes_argument_overrides_the_parameters_shapes():
    """``shapes`` (ZeRO-3 placeholders) lays the parameters out by the given shapes, not their arrays'."""
    params, _ = make_params([(1,), (1,)])
    layout = FlatLayout(params, shapes={id(params[0]): (2, 3), id(params[1]): (5,)})
    assert layout.shapes == [(2, 3), (5,)]
    assert layout.offsets == [(0, 6), (6, 11)] and layout.numel == 11


def test_empty_layout_has_no_elements():
    """A layout of no parameters has numel 0, no views, no segments and no buckets."""
    layout = FlatLayout([])
    assert layout.numel == 0 and layout.views(np.zeros(0)) == []
    assert layout.segments(0, 0) == [] and layout.buckets(1, 4) == []


def test_views_are_the_parameters_and_write_through():
    """``views`` of the concatenated vector reproduce every parameter (shape and values) and are views into it."""
    params, arrays = make_params(SHAPES)
    layout = FlatLayout(params)
    flat = flat_of(arrays)
    views = layout.views(flat)
    assert len(views) == len(arrays)
    for v, a in zip(views, arrays):
        assert v.shape == a.shape
        np.testing.assert_array_equal(v, a)
        if v.size:
            assert np.shares_memory(v, flat)
            v[...] = -v
    np.testing.assert_array_equal(flat, -flat_of(arrays))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_chunks_tile_the_vector(size):
    """The dp chunks of sizes 1..5 tile [0, numel) in rank order, no gap or overlap, sizes within one of each other."""
    params, _ = make_params(SHAPES)
    layout = FlatLayout(params)
    chunks = [layout.chunk(r, size) for r in range(size)]
    assert chunks[0][0] == 0 and chunks[-1][1] == layout.numel
    assert all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))
    lengths = [b - a for a, b in chunks]
    assert min(lengths) >= 0 and max(lengths) - min(lengths) <= 1 and sum(lengths) == layout.numel


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_segments_of_the_chunks_reassemble_the_parameters(size):
    """Each chunk's segments name exactly its elements, tile the chunk in order, and over all ranks
    rebuild every parameter with each element once."""
    params, arrays = make_params(SHAPES)
    layout = FlatLayout(params)
    flat = flat_of(arrays)
    rebuilt = [np.full(a.size, np.nan) for a in arrays]
    seen = [np.zeros(a.size, int) for a in arrays]
    index = {id(p): i for i, p in enumerate(params)}
    for r in range(size):
        lo, hi = layout.chunk(r, size)
        segs = layout.segments(lo, hi)
        pos = 0
        order = [index[id(p)] for p, *_ in segs]
        assert order == sorted(order)
        for p, start, stop, at in segs:
            i = index[id(p)]
            assert at == pos and 0 <= start < stop <= arrays[i].size
            np.testing.assert_array_equal(flat[lo + at:lo + at + stop - start], arrays[i].ravel()[start:stop])
            rebuilt[i][start:stop] = flat[lo + at:lo + at + stop - start]
            seen[i][start:stop] += 1
            pos += stop - start
        assert pos == hi - lo
    for a, got, count in zip(arrays, rebuilt, seen):
        np.testing.assert_array_equal(got, a.ravel())
        assert (count == 1).all()


def test_segments_of_every_range_name_its_elements():
    """For every range [lo, hi) the segments cover it in order, each naming exactly the vector's elements."""
    params, arrays = make_params([(2,), (0,), (3, 1), (1,), (2, 2)])
    layout = FlatLayout(params)
    flat = flat_of(arrays)
    by_id = {id(p): a.ravel() for p, a in zip(params, arrays)}
    for lo in range(layout.numel + 1):
        for hi in range(lo, layout.numel + 1):
            got = []
            for p, start, stop, at in layout.segments(lo, hi):
                assert at == len(got) and start < stop
                got += by_id[id(p)][start:stop].tolist()
            assert got == flat[lo:hi].tolist()


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("elements", [1, 3, 6, 7, 11, 10 ** 6])
def test_buckets_cover_the_vector_from_its_end_in_ranges_of_the_size(itemsize, elements):
    """Buckets run from the end of the vector to 0 without gaps, each exactly ``bucket_bytes`` but
    the last (at 0), each listing the parameters with elements in it, in reverse order: a parameter
    larger than a bucket is in several, so no bucket exceeds the size."""
    params, _ = make_params(SHAPES)
    layout = FlatLayout(params)
    bucket_bytes = elements * itemsize + itemsize - 1  # a part of an element does not count
    buckets = layout.buckets(bucket_bytes, itemsize)
    assert buckets[0][1] == layout.numel and buckets[-1][0] == 0
    assert all(b[0] == c[1] for b, c in zip(buckets, buckets[1:]))
    assert all(hi - lo == elements for lo, hi, _ in buckets[:-1]) and 0 < buckets[-1][1] - buckets[-1][0] <= elements
    for lo, hi, group in buckets:
        assert group == [p for p, (a, b) in reversed(list(zip(params, layout.offsets))) if a < hi and b > lo and a < b]
    if elements >= layout.numel:
        assert len(buckets) == 1
    assert all(sum(p in group for *_, group in buckets) >= 2 for p in params if p.size > elements)


def test_runs_merge_adjacent_selected_parameters_and_skip_the_others():
    """``runs`` of every range and selection are the maximal runs of the selected parameters' elements, relative to lo."""
    shapes = [(2,), (3,), (0,), (1,), (2, 2), (3,), (1,)]
    params, arrays = make_params(shapes)
    layout = FlatLayout(params)
    owner = np.concatenate([np.full(a.size, i) for i, a in enumerate(arrays)])
    selections = {
        "none": set(), "all": set(range(len(params))), "even": {0, 2, 4, 6}, "odd": {1, 3, 5},
        "adjacent": {0, 1, 3}, "around-empty": {1, 3}, "last": {6},
    }
    for chosen in selections.values():
        names = {f"p{i}" for i in chosen}
        select = lambda p: p.name in names  # noqa: E731
        mask = np.isin(owner, sorted(chosen))
        for lo in range(layout.numel + 1):
            for hi in range(lo, layout.numel + 1):
                assert layout.runs(lo, hi, select) == true_runs(mask[lo:hi]), (chosen, lo, hi)


# --- ShardedLayout: the chunks a dp rank owns, several layouts' back to back in one shard ----------
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_sharded_layouts_place_each_ranks_chunks_back_to_back(size):
    """Three layouts (groups) of SHAPES: each rank's owned chunks, placed back to back, make its
    shard; the shards of all ranks, chunk by chunk, give every group's flat vector again; shard
    runs are the chunk's runs moved to the chunk's place in the shard."""
    params, arrays = make_params(SHAPES)
    groups = [params[:3], params[3:5], params[5:]]
    flats = [flat_of([a for p, a in zip(params, arrays) if p in g]) for g in groups]
    shards = []
    for rank in range(size):
        layouts = [ShardedLayout(g, None, rank, size) for g in groups]
        n = place_shards(layouts)
        assert [g.shard_offset for g in layouts] == list(itertools.accumulate([0] + [g.hi - g.lo for g in layouts]))[:3]
        shard = np.concatenate([flat[g.lo:g.hi] for g, flat in zip(layouts, flats)])
        assert n == shard.size
        for g, flat in zip(layouts, flats):
            picked = lambda p: p.name in ("p0", "p4", "p7")  # noqa: E731
            odd = [(a + g.shard_offset, b + g.shard_offset) for a, b in g.runs(g.lo, g.hi, picked)]
            assert g.shard_runs(picked) == odd
            for a, b in odd:  # a shard run holds the selected parameters' elements only
                assert np.array_equal(shard[a:b], flat[g.lo + a - g.shard_offset:g.lo + b - g.shard_offset])
        shards.append((layouts, shard))
    for i, flat in enumerate(flats):
        rebuilt = np.concatenate([shard[ls[i].shard_offset:ls[i].shard_offset + ls[i].hi - ls[i].lo]
                                  for ls, shard in shards])
        assert np.array_equal(rebuilt, flat)


def test_trainable_keeps_the_parameters_that_need_gradients_and_refuses_mixtures():
    params, _ = make_params(SHAPES[:3])
    params[1].requires_grad = False
    assert trainable(params, "store") == [params[0], params[2]]
    assert trainable([params[1]], "store") == []
    with pytest.raises(ValueError, match="^store: no parameter requires a gradient"):
        trainable([params[1]], "store", allow_empty=False)
    with pytest.raises(ValueError, match="^store: a parameter appears twice"):
        trainable([params[0], params[0]], "store")
    mixed, _ = make_params([(2,)], dtype="float32")
    with pytest.raises(ValueError, match=r"^store: all parameters must share one dtype, got \['float32', 'float64'\]"):
        trainable([params[0], mixed[0]], "store")


# --- counting, sums of squares, clipping ------------------------------------------------------------
def test_count_once_counts_replicated_parameters_on_tp_rank_0_only_and_tied_copies_never():
    """``count_once``: a tp-split parameter counts on every tp rank, a replicated one on rank 0 only, a tied copy nowhere."""
    split = Parameter((4, 2), spec=ShardSpec(("tp", None)))
    qkv = Parameter((2, 6), spec=ShardSpec((None, "tp"), blocks=(1, 3)))
    repl = Parameter((3,))
    tied = Parameter((4, 2), spec=ShardSpec(("tp", None)))
    split.name, qkv.name, repl.name, tied.name = "split", "qkv", "ln", "wte"
    for rank in (0, 1, 2):
        counted = count_once(rank, tied_copy=["wte"])
        assert counted(split) and counted(qkv)
        assert counted(repl) == (rank == 0)
        assert not counted(tied)
        assert count_once(rank)(tied)


def test_sum_squares_over_runs_matches_numpy():
    """``sum_squares`` is the sum of squares of exactly the elements in the runs (float64, exact ranges)."""
    flat = np.random.default_rng(0).standard_normal(23)
    runs = [(0, 3), (5, 6), (9, 20), (22, 23)]
    want = sum(float(np.sum(flat[a:b] ** 2)) for a, b in runs)
    assert sum_squares(flat, runs) == pytest.approx(want, rel=1e-14)
    assert sum_squares(flat, []) == 0
    assert sum_squares(flat, [(0, 23)]) == pytest.approx(float(flat @ flat), rel=1e-14)


def test_sum_squares_of_half_gradients_sums_in_float32():
    """Half gradients are squared and summed in float32: squares beyond float16's range stay finite and exact."""
    flat = np.array([300.0, 400.0, 1.0, 500.0], dtype=np.float16)
    got = sum_squares(flat, [(0, 2), (3, 4)])
    assert math.isfinite(got) and got == 300.0 ** 2 + 400.0 ** 2 + 500.0 ** 2


def test_clip_flat_scales_every_gradient_array_when_the_norm_exceeds_max_norm():
    """Without communicators the norm is sqrt(local_sq); above max_norm every array is scaled by max_norm / (norm + 1e-6)."""
    g1, g2 = np.array([3.0, 0.0]), np.array([[4.0]])
    norm = clip_flat(25.0, [g1, g2], (), 1.0)
    assert norm == 5.0
    coef = 1.0 / (5.0 + 1e-6)
    np.testing.assert_allclose(g1, [3.0 * coef, 0.0], rtol=1e-15)
    np.testing.assert_allclose(g2, [[4.0 * coef]], rtol=1e-15)


@pytest.mark.parametrize("local_sq, max_norm", [(25.0, 5.0), (16.0, 5.0), (25.0, None), (math.inf, 1.0),
                                                (math.nan, 1.0), (0.0, 0.5)])
def test_clip_flat_leaves_the_gradients_alone_otherwise(local_sq, max_norm):
    """At or below max_norm, with max_norm None, or for a non-finite norm nothing is scaled; the norm is returned."""
    g = np.array([1.0, -2.0, 3.0])
    norm = clip_flat(local_sq, [g], (None,), max_norm)
    assert norm == math.sqrt(local_sq) or (math.isnan(norm) and math.isnan(local_sq))
    np.testing.assert_array_equal(g, [1.0, -2.0, 3.0])


def test_store_clip_counts_only_the_counted_parameters():
    """``FlatParams.clip`` (no communicators): the norm over the counted parameters' gradients only, scaling the whole vector."""
    split = Parameter((2, 2), spec=ShardSpec(("tp", None)), dtype="float64")
    repl = Parameter((3,), dtype="float64")
    tied = Parameter((2,), spec=ShardSpec(("tp",)), dtype="float64")
    for p, name in [(split, "split"), (repl, "ln"), (tied, "wte")]:
        p.data, p.name = np.zeros(p.shape), name
    store = FlatParams([split, repl, tied], count_once(1, ["wte"]))
    assert store.data.shape == (9,) and all(p.data.base is store.data for p in (split, repl, tied))
    split.grad[...] = [[1.0, 2.0], [2.0, 4.0]]
    repl.grad[...] = 100.0
    tied.grad[...] = 100.0
    norm = store.clip(1.0)
    assert norm == 5.0
    np.testing.assert_allclose(store.grad, np.r_[[1, 2, 2, 4], [100] * 5] / (5.0 + 1e-6), rtol=1e-15)


# --- flat boxes of sharded checkpoints --------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1,), (4, 1), (1, 1, 4), (2, 1, 3, 2), (3, 3)])
def test_flat_boxes_are_contiguous_runs_in_order(shape):
    """``_flat_boxes`` of every [lo, hi): boxes of the array's rank, inside it, whose C-order elements concatenate to lo..hi-1."""
    n = math.prod(shape)
    full = np.arange(n).reshape(shape)
    for lo in range(n + 1):
        for hi in range(n + 1):
            boxes = _flat_boxes(shape, lo, hi)
            if lo >= hi:
                assert boxes == []
                continue
            got = []
            for start, box in boxes:
                assert len(start) == len(box) == len(shape)
                assert all(0 <= s and 1 <= b and s + b <= m for s, b, m in zip(start, box, shape))
                got += full[tuple(slice(s, s + b) for s, b in zip(start, box))].ravel().tolist()
            assert got == list(range(lo, hi))


def hand_shard(full, dims, blocks, tp, rank):
    """This tp rank's slice of ``full``: per split dimension, its piece of each block (block weights)."""
    out = full
    for d, axis in enumerate(dims):
        if axis is None:
            continue
        k = (blocks or (1,) * len(dims))[d]
        weights = [1] * k if isinstance(k, int) else list(k)
        unit = full.shape[d] // sum(weights)
        keep, start = [], 0
        for w in weights:
            piece = w * unit // tp
            keep += range(start + rank * piece, start + (rank + 1) * piece)
            start += w * unit
        out = np.take(out, keep, axis=d)
    return out


def checkpoint_params(tp):
    """``(param, full, logical)`` for parameters of every kind at ``tp``: replicated 1-D and odd 2-D,
    column and row splits, a fused q|k|v weight and bias (3 blocks), a grouped-query q|k|v weight
    (blocks 2:1:1), a vocabulary-padded embedding, a zero-size one. ``full`` holds 1.. on the
    logical tensor, negative numbers in the padding rows."""
    C = 4
    specs = [
        ("ln", (5,), ShardSpec((None,))),
        ("odd", (3, 5), ShardSpec((None, None))),
        ("col", (3, 4), ShardSpec((None, "tp"))),
        ("row", (6, 3), ShardSpec(("tp", None))),
        ("qkv", (C, 3 * C), ShardSpec((None, "tp"), blocks=(1, 3))),
        ("qkv_b", (3 * C,), ShardSpec(("tp",), blocks=(3,))),
        ("gqa", (C, 8), ShardSpec((None, "tp"), blocks=(1, (2, 1, 1)))),
        ("empty", (0,), ShardSpec((None,))),
    ]
    out, n = [], 1
    for name, shape, spec in specs:
        p = Parameter(shape, spec=spec, dtype="float64")
        full = np.arange(n, n + math.prod(shape), dtype=np.float64).reshape(shape)
        n += full.size
        out.append((p.defer(spec.local_shape(shape, {"tp": tp})), full, shape))
        p.name = name
    vocab, dim = 5, 3
    rows = pad_vocab(vocab, tp)
    spec = ShardSpec(("tp", None))
    p = PaddedParameter((rows, dim), (vocab, dim), spec=spec, dtype="float64")
    p.name = "wte"
    full = -np.arange(1, rows * dim + 1, dtype=np.float64).reshape(rows, dim)
    full[:vocab] = np.arange(n, n + vocab * dim).reshape(vocab, dim)
    out.append((p.defer(spec.local_shape((rows, dim), {"tp": tp})), full, (vocab, dim)))
    return out


def test_runs_of_a_fused_qkv_slice_have_one_run_per_block():
    """``_runs`` of a q|k|v weight at tp 2: rows whole, columns one (local, global, length) run per block; merged at tp 1."""
    p = Parameter((4, 12), spec=ShardSpec((None, "tp"), blocks=(1, 3)))
    assert _runs(p, {"tp": 2}, {"tp": 0}) == [[(0, 0, 4)], [(0, 0, 2), (2, 4, 2), (4, 8, 2)]]
    assert _runs(p, {"tp": 2}, {"tp": 1}) == [[(0, 0, 4)], [(0, 2, 2), (2, 6, 2), (4, 10, 2)]]
    assert _runs(p, {"tp": 1}, {"tp": 0}) == [[(0, 0, 4)], [(0, 0, 12)]]
    gqa = Parameter((4, 8), spec=ShardSpec((None, "tp"), blocks=(1, (2, 1, 1))))
    assert _runs(gqa, {"tp": 2}, {"tp": 1}) == [[(0, 0, 4)], [(0, 2, 2), (2, 5, 1), (3, 7, 1)]]


def test_runs_leave_out_the_padding_rows():
    """``_runs`` cuts a padded embedding's rows to the vocabulary: a rank of padding only has no rows."""
    p = PaddedParameter((6, 3), (4, 3), spec=ShardSpec(("tp", None)))
    assert _runs(p, {"tp": 3}, {"tp": 0}) == [[(0, 0, 2)], [(0, 0, 3)]]
    assert _runs(p, {"tp": 3}, {"tp": 1}) == [[(0, 2, 2)], [(0, 0, 3)]]
    assert _runs(p, {"tp": 3}, {"tp": 2}) == [[], [(0, 0, 3)]]
    assert list(_boxes(p, ({"tp": 3}, {"tp": 2}), np.zeros((2, 3)))) == []
    p2 = PaddedParameter((6, 3), (5, 3), spec=ShardSpec(("tp", None)))
    assert _runs(p2, {"tp": 2}, {"tp": 1}) == [[(0, 3, 2)], [(0, 0, 3)]]


def check_boxes(p, tp, rank, array, lo, full, logical, seen):
    """Every box of ``array`` lies in the logical tensor and holds exactly its elements (a view into
    ``array``); counts the elements covered in ``seen``. Returns the number of elements boxed."""
    boxed = 0
    for start, shape, view in _boxes(p, ({"tp": tp}, {"tp": rank}), array, lo):
        assert len(start) == len(shape) == len(logical)
        assert all(0 <= s and 1 <= n and s + n <= m for s, n, m in zip(start, shape, logical))
        box = tuple(slice(s, s + n) for s, n in zip(start, shape))
        assert view.shape == tuple(shape) and np.shares_memory(view, array)
        np.testing.assert_array_equal(view, full[box])
        seen[box] += 1
        boxed += view.size
    return boxed


@pytest.mark.parametrize("tp", [1, 2])
def test_boxes_of_whole_tp_slices_reassemble_the_global_tensors(tp):
    """``_boxes`` of each rank's whole tp slice name exactly its elements; over the ranks they cover
    a split tensor once, a replicated one once per rank, padding never."""
    for p, full, logical in checkpoint_params(tp):
        seen = np.zeros(logical, int)
        for rank in range(tp):
            local = hand_shard(full, p.spec.dims, p.spec.blocks, tp, rank)
            assert local.shape == p.shape
            boxed = check_boxes(p, tp, rank, local, None, full, logical, seen)
            assert boxed == int((local > 0).sum())
        assert (seen == (1 if "tp" in p.spec.dims else tp)).all(), p.name


@pytest.mark.parametrize("tp", [1, 2])
def test_boxes_of_every_zero_segment_reassemble_the_global_tensors(tp):
    """For dp sizes 1..5, the boxes of every ZeRO segment of every tp slice name exactly its elements,
    cover each global tensor (split: once, replicated: once per tp rank) and never a padding row; filling
    the boxes of a zeroed segment from the global tensor rebuilds the segment (padding left zero)."""
    entries = checkpoint_params(tp)
    for dp in range(1, 6):
        seen = {p.name: np.zeros(logical, int) for p, _, logical in entries}
        for rank in range(tp):
            locals_ = [hand_shard(full, p.spec.dims, p.spec.blocks, tp, rank) for p, full, _ in entries]
            layout = FlatLayout([p for p, *_ in entries])
            flat = flat_of(locals_)
            by_name = {p.name: (full, logical) for p, full, logical in entries}
            for r in range(dp):
                lo, hi = layout.chunk(r, dp)
                for p, a, b, pos in layout.segments(lo, hi):
                    full, logical = by_name[p.name]
                    segment = flat[lo + pos:lo + pos + b - a].copy()
                    boxed = check_boxes(p, tp, rank, segment, a, full, logical, seen[p.name])
                    assert boxed == int((segment > 0).sum())
                    loaded = np.zeros_like(segment)
                    for start, shape, view in _boxes(p, ({"tp": tp}, {"tp": rank}), loaded, a):
                        view[...] = full[tuple(slice(s, s + n) for s, n in zip(start, shape))]
                    np.testing.assert_array_equal(loaded, np.where(segment > 0, segment, 0))
        for p, _, _ in entries:
            want = 1 if "tp" in p.spec.dims else tp
            assert (seen[p.name] == want).all(), (p.name, dp)


def test_box_views_of_a_segment_never_overlap():
    """The views of one segment's boxes are disjoint and, padding aside, cover the segment."""
    for tp, rank in itertools.product([1, 2], [0, 1]):
        if rank >= tp:
            continue
        for p, full, logical in checkpoint_params(tp):
            local = hand_shard(full, p.spec.dims, p.spec.blocks, tp, rank).ravel()
            for lo, hi in [(0, local.size), (1, local.size - 1), (local.size // 3, local.size // 3 + 5)]:
                if not 0 <= lo < hi <= local.size:
                    continue
                marks = np.zeros(hi - lo, int)
                for _, _, view in _boxes(p, ({"tp": tp}, {"tp": rank}), marks, lo):
                    view += 1
                np.testing.assert_array_equal(marks, (local[lo:hi] > 0).astype(int))
