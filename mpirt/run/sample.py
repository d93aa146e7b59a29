"""Generate text from a checkpoint: ``python -m mpirt.sample [--ckpt out/ckpt] [--prompt TEXT] ...``."""
from __future__ import annotations

import argparse
import sys

import numpy as np

import mpirt.core.backend as B
from mpirt.checkpoint.store import load_checkpoint, looks_like_checkpoint, verify_checkpoint
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
    parser = argparse.ArgumentParser(prog="python -m mpirt.sample", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--ckpt", default="out/ckpt", help="mpirt checkpoint directory")
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--tokens", type=int, default=300, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--data", default=None, help="dataset whose tokenizer to use (default: the training data)")
    args = parser.parse_args(argv)
    if not looks_like_checkpoint(args.ckpt):
        parser.exit(2, f"error: --ckpt {args.ckpt} is not an mpirt checkpoint\n")
    try:  # a damaged checkpoint or dataset: one line naming the file, never a traceback
        meta = verify_checkpoint(args.ckpt)
        model_cfg = config_from_dict(meta["extra"]["model_config"])
        data = TokenDataset(args.data or meta["extra"]["data"])
        model = build_model(model_cfg, dtype=meta["config"]["dtype"], seed=0)
        load_checkpoint(args.ckpt, model)
    except KeyError as err:
        parser.exit(2, f"error: --ckpt {args.ckpt}: its meta.json has no {err} (not written by mpirt.train)\n")
    except (OSError, ValueError, TypeError) as err:
        parser.exit(2, f"error: --ckpt {args.ckpt}: {err}\n")
    prompt_ids = data.encode(args.prompt)
    if not prompt_ids:
        parser.exit(2, "error: --prompt encodes to no tokens\n")
    context = min(model_cfg.n_positions, meta["config"].get("seq_len", model_cfg.n_positions))
    ids = generate(model, prompt_ids, context, tokens=args.tokens, temperature=args.temperature,
                   top_k=args.top_k, rng=np.random.default_rng(args.seed))
    text = data.decode(ids)
    sys.stdout.write(text + "\n")
    return text
