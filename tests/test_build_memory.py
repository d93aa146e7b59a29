"""Building a big model never holds it whole: lazy parameters, seeded slices generated chunk by
chunk, and the memory (tracemalloc: NumPy reports its allocations to it) of building a model, a
tensor-parallel model, a pipeline stage, loading a sharded checkpoint and initialising from a
Hugging Face directory, each against this rank's own slices plus the largest full parameter."""
import zlib

import numpy as np
import pytest

import mpirt.nn as nn
from mpirt.nn import NotMaterializedError, Parameter, ShardSpec
from mpirt.parallel.tensor.layout import PaddedParameter

SPECS = [((12, 6), None), ((12, 6), ShardSpec(("tp", None))), ((12, 6), ShardSpec((None, "tp"))),
         ((4, 12), ShardSpec((None, "tp"), blocks=(1, 3))), ((12, 5), ShardSpec(("tp", None), blocks=(3, 1))),
         ((10,), ShardSpec(("tp",))), ((5,), None), ((3, 4, 6), ShardSpec((None, None, "tp")))]


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 19])
def test_init_slice_is_the_full_init_sliced_bit_for_bit(monkeypatch, dtype, chunk):
    """Generated in chunks (cut inside rows, at rows, or whole), every rank's slice of every spec
    is ``spec.shard(full_init)`` rounded to the dtype, for every init kind and the padded table."""
    monkeypatch.setattr(nn, "INIT_CHUNK", chunk)
    params = [Parameter(shape, init=init, std=0.3, spec=spec, dtype=dtype)
              for shape, spec in SPECS for init in ("normal", "ones", "zeros")]
    params += [PaddedParameter((12, 4), (11, 4), init=init, spec=ShardSpec(("tp", None)), dtype=dtype)
               for init in ("normal", "ones")]
    for i, p in enumerate(params):
        p.name = f"layer.{i}.weight"
        for tp in (1, 2, 3, 4):
            try:
                p.spec.local_shape(p.global_shape, {"tp": tp})
            except ValueError:
                continue  # this tp does not divide the shape
            for r in range(tp):
                want = np.asarray(p.spec.shard(p.full_init(7), {"tp": tp}, {"tp": r}), dtype=dtype)
                got = p.init_slice(7, {"tp": tp}, {"tp": r})
                assert got.dtype == np.dtype(dtype) and got.shape == want.shape
                assert got.tobytes() == want.tobytes(), (p, tp, r)


def test_full_init_numbers_unchanged():
    """The seeded numbers themselves (what every checkpoint and parity test builds on)."""
    p = Parameter((3, 2), std=0.02)
    p.name = "h.0.mlp.c_fc.weight"
    rng = np.random.default_rng([5, zlib.crc32(p.name.encode())])
    assert p.full_init(5).tobytes() == (rng.standard_normal((3, 2)) * 0.02).tobytes()


def test_a_lazy_parameter_says_so_and_knows_its_shape():
    from mpirt.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=8, n_positions=8, vocab_size=11), dtype="float64")
    p = model.h[0].attn.c_attn.weight
    assert not p.materialized and p.shape == (8, 24) and p.dtype == np.float64 and p.size == 192
    with pytest.raises(NotMaterializedError, match=r"h\.0\.attn\.c_attn\.weight \(8, 24\) float64 has no value yet"):
        p.data
    with pytest.raises(NotMaterializedError, match="wte.weight"):
        model(np.zeros((1, 4), np.int64))
    with pytest.raises(NotMaterializedError):
        model.state_dict()
    model.load_state_dict({n: np.ones(q.shape) for n, q in model.named_parameters()})  # loading materialises
    assert p.materialized and (p.data == 1).all()
    model.initialize(3)
    assert np.array_equal(p.data, p.full_init(3))
