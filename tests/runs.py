"""Helpers for the tests that run ``python -m mpirt.train``: a tiny model's command line and rank
0's per-step metrics."""
import json

TINY = ["--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2", "--model.n_positions=32",
        "--seq-len=16", "--batch-size=4", "--eval-batches=2", "--eval-interval=0", "--progress=false",
        "--warmup-steps=2"]


def read_metrics(out) -> list[dict]:
    """Rank 0's metrics records (one a training step) of the run in ``out``."""
    return [json.loads(line) for line in (out / "metrics" / "rank0.jsonl").read_text().splitlines()]
