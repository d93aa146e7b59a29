"""Generate text from a checkpoint: ``python -m mpirt.sample [--ckpt out/ckpt] [--prompt TEXT] ...``."""
from __future__ import annotations

import argparse
import sys

import numpy as np

import mpirt.core.backend as B
from mpirt.checkpoint.store import is_checkpoint, load_checkpoint, read_checkpoint_meta
from mpirt.data.tokens import TokenDataset
from mpirt.core.tensor import no_grad
from mpirt.core.modeling import build_model, config_from_dict


def generate(model, ids: list[int], context: int, *, tokens: int, temperature: float, top_k: int,
             rng: np.random.Generator) -> list[int]:
    """Extend ``ids`` by ``tokens`` tokens sampled from ``model``, seeing at most the last
    ``context`` tokens (the sequence length it was trained on: later positions are untrained)."""
    ids = list(ids)
    model.eval()
    with no_grad():
        for _ in range(tokens):
            window = B.asarray(np.asarray(ids[-context:], dtype=np.int64)[None, :])  # (1, T)
            logits = B.to_host(model(window).data[0, -1]).astype(np.float64)  # (V,)
            if temperature == 0:
                ids.append(int(logits.argmax()))
                continue
            logits /= temperature
            if 0 < top_k < logits.size:
                logits[logits < np.partition(logits, -top_k)[-top_k]] = -np.inf
            p = np.exp(logits - logits.max())
            ids.append(int(rng.choice(p.size, p=p / p.sum())))
    return ids


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(prog="python -m mpirt.sample", description=__doc__)
    parser.add_argument("--ckpt", default="out/ckpt", help="mpirt checkpoint directory (default out/ckpt)")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=300, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="dataset whose tokenizer to use (default: the training data)")
    args = parser.parse_args(argv)
    if not is_checkpoint(args.ckpt):
        parser.exit(2, f"error: --ckpt {args.ckpt} is not an mpirt checkpoint\n")
    meta = read_checkpoint_meta(args.ckpt)
    model_cfg = config_from_dict(meta["extra"]["model_config"])
    data = TokenDataset(args.data or meta["extra"]["data"])
    model = build_model(model_cfg, dtype=meta["config"]["dtype"], seed=0)
    load_checkpoint(args.ckpt, model)
    prompt_ids = data.encode(args.prompt)
    if not prompt_ids:
        parser.exit(2, "error: --prompt encodes to no tokens\n")
    context = min(model_cfg.n_positions, meta["config"].get("seq_len", model_cfg.n_positions))
    ids = generate(model, prompt_ids, context, tokens=args.tokens, temperature=args.temperature,
                   top_k=args.top_k, rng=np.random.default_rng(args.seed))
    text = data.decode(ids)
    sys.stdout.write(text + "\n")
    return text
