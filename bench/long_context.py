"""A sequence too long for one rank's memory budget trains under context parallelism within it.

    python bench/long_context.py                        # seq 4096, cp 4, a budget only cp 4 fits
    python bench/long_context.py --seq-len 8192 --layout="--cp=2 --tp=2" --budget 300MiB

A small GPT with attention dropout (whose per-layer masks are the attention's largest
activation, B H T^2 bytes) at a long sequence: one rank is refused under the budget, the layout
trains within it with one rank's losses, beside data parallelism's tokens/s (the steps are
:mod:`budget`'s). Results: ``bench/results/long_context.json`` and ``.md``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import budget  # noqa: E402

if __name__ == "__main__":
    args = budget.parser(__doc__, model="tiny", model_args="--model.n_layer=2 --model.n_embd=64 --model.n_head=4 "
                         "--model.attn_pdrop=0.1", seq_len=4096, batch_size=4, layout="--cp=4").parse_args()
    budget.main(args, "long_context", "Long context: one rank's budget, context parallelism within it", "cp",
                "attention dropout's masks B H T^2 per layer")
