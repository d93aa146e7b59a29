"""A mixture of experts with more experts than one rank's memory budget holds trains with its
experts split over ranks (expert parallelism) within it.

    python bench/moe.py                                 # 16 experts, ep 4, a budget only ep 4 fits
    python bench/moe.py --layout="--dp=4 --ep=2 --zero=1" --budget 400MiB

A Mixtral-style model whose 16 SwiGLU experts per block hold nearly all its weights: one rank
and data parallelism (every rank holding every expert, with its gradient and AdamW state) exceed
the budget; at ep 4 each rank holds 4 experts per block, its tokens going to the others'
experts by all-to-all. One rank is refused under the budget, the layout trains within it with
one rank's losses, beside data parallelism's tokens/s and comm share (the steps are
:mod:`budget`'s). Results: ``bench/results/moe.json`` and ``.md``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import budget  # noqa: E402

if __name__ == "__main__":
    args = budget.parser(__doc__, model="mixtral-tiny", model_args="--model.n_expert=16 --model.n_inner=512",
                         seq_len=128, batch_size=8, layout="--dp=4 --ep=4").parse_args()
    budget.main(args, "moe", "Mixture of experts: one rank's budget, expert parallelism within it", "ep",
                "16 experts of 3 x 128 x 512 per block, top 2, dropless")
