"""Parameter groups (mpirt.parallel.groups): what the engine does to each group after backward."""
import numpy as np
import pytest

from conftest import agree


@pytest.mark.mpi(min_size=2)
def test_every_group_sums_its_partial_gradients_over_tp(group):
    """Sequence parallelism's partial gradients are summed over tp in every group, the experts'
    as well as the dense ones (without ZeRO the engine once summed the dense store's only)."""
    from mpi4py import MPI

    from mpirt.comm import Comm
    from mpirt.core.nn import Parameter
    from mpirt.parallel.flat import FlatParams
    from mpirt.parallel.groups import DataParallelSync, ParamGroup, finish_backward

    tp = group(2, "tp")
    sums = {}
    if tp is not None:
        alone = Comm(MPI.COMM_SELF, "dp")  # one replica: nothing to average
        groups = []
        for name in ("dense", "experts"):
            p = Parameter((3,), dtype="float64")
            p.data, p.name, p.tp_partial_grad = np.zeros(3), name, True
            sync = DataParallelSync(FlatParams([p]), alone, lr=0.0)
            sync.zero_grad()
            p.grad += tp.rank + 1.0  # this tp rank's part of the sum
            groups.append(ParamGroup(name, sync.store, alone, sync, sync.optimizer))
        finish_backward(groups, tp)
        sums = {g.name: g.store.grad.tolist() for g in groups}
    agree(tp is None or sums == {"dense": [3.0] * 3, "experts": [3.0] * 3}, sums)
