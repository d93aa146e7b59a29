"""Expert parallelism (mpirt.parallel.experts) at the layer: one MoE layer whose experts are split
over every rank of MPI_COMM_WORLD (ep = world size, two experts per rank) against the same layer
whole on one rank, run by every rank on the whole batch. Outputs, input gradients, the router's
and the experts' gradients, tokens per expert and capacity drops must agree (float64); a router
that sends no token to the last rank's experts must neither hang nor skip a collective.
Training runs at ep 2 and 4 are launch tests in test_train_parallel.py."""
import numpy as np
import pytest

from conftest import agree
from mpirt.core.tensor import Tensor
from mpirt.models import Mixtral, MoEConfig
from mpirt.parallel.layout import Layout

ROWS = 2  # sequences per rank


def layers(ep: int, capacity: float):
    """The reference layer and the one to split (equal weights), ``2 ep`` experts of top 2. Without
    the load-balancing loss: its gradient is a mean over the sequences a rank holds (the training
    launch tests hold it against one rank)."""
    cfg = MoEConfig(n_layer=1, n_head=4, n_embd=16, n_positions=16, vocab_size=64, n_inner=24, n_expert=2 * ep,
                    top_k=2, aux_loss_coef=0.0, capacity_factor=capacity)
    return Mixtral(cfg, dtype="float64", seed=3).h[0].mlp, Mixtral(cfg, dtype="float64", seed=3).h[0].mlp


def bias_away_from_the_last_rank(mlp, rng):
    """Positive router weights, -1 for the last rank's two experts: with positive inputs no token picks them."""
    gate = mlp.gate.weight.data
    gate[...] = rng.uniform(0.5, 1.0, gate.shape)
    gate[:, -2:] = -1.0


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("capacity, biased", [(0.0, False), (1.0, False), (0.0, True)],
                         ids=["dropless", "capacity", "empty-experts"])
def test_split_experts_equal_the_whole_layer(capacity, biased):
    from mpi4py import MPI
    from mpirt.comm import Comm
    from mpirt.parallel.experts import parallelize_experts

    world = MPI.COMM_WORLD
    ep, rank = world.Get_size(), world.Get_rank()
    whole, split = layers(ep, capacity)
    rng = np.random.default_rng(7)
    if biased:
        bias_away_from_the_last_rank(whole, rng)
        split.gate.weight.data[...] = whole.gate.weight.data
    low, high = (0.1, 1.0) if biased else (-1.0, 1.0)
    x = rng.uniform(low, high, (ep * ROWS, 16, 16))
    g = rng.standard_normal(x.shape)

    xt = Tensor(x, requires_grad=True)
    ref = whole(xt)
    ref.backward(g)

    comm = Comm(world.Dup(), "ep")
    full = {id(p): p.data.copy() for p in split.expert_weights()}
    parallelize_experts(split, comm)
    local = slice(2 * rank, 2 * rank + 2)  # this rank's experts
    for p in split.expert_weights():
        p.data = full[id(p)][local]
    mine = slice(rank * ROWS, (rank + 1) * ROWS)
    xs = Tensor(x[mine].copy(), requires_grad=True)
    out = split(xs)
    out.backward(g[mine])

    fails = []

    def close(what, got, want):
        if not np.allclose(got, want, rtol=1e-10, atol=1e-13):
            fails.append(f"rank {rank}: {what} differs by {np.abs(got - want).max():.3g}")

    close("output", out.data, ref.data[mine])
    close("input gradient", xs.grad, xt.grad[mine])
    router = world.allreduce(split.gate.weight.grad, op=MPI.SUM)  # each rank's tokens' part
    close("router gradient", router, whole.gate.weight.grad)
    for name in ("w_gate", "w_up", "w_down"):  # the ep group's mean: times ep is the whole batch's sum
        close(f"{name} gradient", getattr(split, name).grad * ep, getattr(whole, name).grad[local])
    tokens = world.allreduce(split.stats["tokens_per_expert"], op=MPI.SUM)
    dropped = world.allreduce(split.stats["dropped"], op=MPI.SUM)
    if tokens.tolist() != whole.stats["tokens_per_expert"].tolist() or dropped != whole.stats["dropped"]:
        fails.append(f"rank {rank}: tokens {tokens.tolist()} dropped {dropped}, one rank "
                     f"{whole.stats['tokens_per_expert'].tolist()} {whole.stats['dropped']}")
    if capacity and not dropped:
        fails.append("capacity 1.0 dropped nothing: the test does not test drops")
    if biased and rank == ep - 1 and (tokens[-2:].any() or split.w_gate.grad.any()):
        fails.append(f"the last rank's experts got tokens {tokens[-2:].tolist()} or a gradient")
    comm.free()
    agree(not fails, fails)


@pytest.mark.mpi(min_size=2)
def test_a_split_model_keeps_what_the_formula_says_at_its_load():
    """Under ep a rank keeps the rows its experts received (``load`` x its own assignments) and the
    outputs received back, not the rows it sent nor its experts' outputs before they went back:
    kept_bytes of a whole model (embed, blocks, head) against Mixtral.activation_bytes_of at the
    rank's measured load, within 3% on every rank (one rank's formula counted 2 k u more per block
    at load 1)."""
    from mpi4py import MPI
    from mpirt.comm import Comm
    from mpirt.core.modeling import load_model_config
    from mpirt.core.nn import kept_bytes
    from mpirt.parallel.experts import expert_layers, parallelize_experts

    world = MPI.COMM_WORLD
    ep, rank = world.Get_size(), world.Get_rank()
    cfg = load_model_config("mixtral-tiny", {"n_expert": 2 * ep})
    model = Mixtral(cfg, dtype="float32", seed=1)
    full = {id(p): p.data.copy() for layer in expert_layers(model) for p in layer.expert_weights()}
    comm = Comm(world.Dup(), "ep")
    parallelize_experts(model, comm)
    for layer in expert_layers(model):
        for p in layer.expert_weights():
            p.data = full[id(p)][2 * rank:2 * rank + 2]
    x = np.random.default_rng(rank).integers(0, cfg.vocab_size, (ROWS, 64))
    _, loss = model(x, x)
    loads = [layer.expert_parallel.take_load() for layer in expert_layers(model)]
    ran, assigned = sum(r for r, _, _ in loads), sum(a for _, a, _ in loads)
    a = Mixtral.activation_bytes_of(cfg, Layout.micro_batch(ROWS, 64, ep=ep), expert_load=ran / assigned)
    predicted, kept = a["embed"] + a["head"] + cfg.n_layer * a["block"], kept_bytes(loss)
    comm.free()
    agree(abs(kept - predicted) <= 0.03 * predicted, f"rank {rank}: kept {kept}, predicted {predicted}")


def test_a_layer_keeps_its_experts_whole_without_expert_parallelism():
    """ep of one rank changes nothing: no hook, the stacked weights' full shape."""
    from mpirt.parallel.experts import parallelize_experts

    class OneRank:
        size, rank = 1, 0

    whole, split = layers(1, 0.0)
    parallelize_experts(split, OneRank())
    assert split.expert_parallel is None and split.w_gate.shape == whole.w_gate.shape


def test_a_split_refuses_an_ep_that_does_not_divide_the_experts():
    from mpirt.parallel.experts import ExpertParallel

    class ThreeRanks:
        size, rank = 3, 0

    with pytest.raises(ValueError, match="ep: 3 does not divide n_expert=4"):
        ExpertParallel(ThreeRanks(), 4)
