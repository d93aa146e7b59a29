"""``python -m mpirt.checkpoint info DIR`` and ``python -m mpirt.checkpoint export DIR OUT``.

``info`` prints what a checkpoint holds (step, format, layout, files, every tensor's shape, dtype
and number of shards) after checking meta.json. ``export`` writes a Hugging Face directory (GPT-2, Llama or Mixtral)
(config.json + model.safetensors) reading one tensor at a time: nothing larger than one tensor is
in memory. Checksums are verified first by both.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mpirt.checkpoint.store import CheckpointError, CheckpointReader, verify_checkpoint
from mpirt.checkpoint.sharded import write_safetensors
from mpirt.core.modeling import config_from_dict, model_label
from mpirt.models.hf import HF_FAMILIES, PREFIX, SINGLE_FILE, hf_config_dict, param_shapes, save_hf_tokenizer


def info(directory) -> str:
    """A description of the checkpoint at ``directory`` (root or version), one line per tensor."""
    meta = verify_checkpoint(directory)
    extra = meta.get("extra") or {}
    model, config = extra.get("model_config") or {}, meta.get("config") or {}
    shape = ", ".join(f"{k} {model[k]}" for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
                      if k in model)
    loss = extra.get("loss")
    lines = [f"{meta['path']}: {meta['format']} version {meta['version']}, step {meta['step']}",
             f"  model {model_label(config.get('model', '?'), extra.get('model_source'), model.get('model_type', '?'))}"
             f" ({model.get('model_type', '?')}: {shape or 'no model config'}), "
             f"dtype {config.get('dtype', '?')}, training loss at this step "
             + (f"{loss:.4f}" if isinstance(loss, (int, float)) else "not recorded"),
             f"  saved on layout {extra.get('layout')}; optimizer "
             f"{(meta['optimizer'] or {}).get('type')}; {len(meta['files'])} files, "
             f"{sum(f['bytes'] for f in meta['files'].values())} bytes"]
    for fname, f in sorted(meta["files"].items()):
        lines.append(f"  file {fname}: {f['bytes']} bytes, sha256 {f['sha256']}")
    for kind in CheckpointReader.KINDS:
        for name, e in sorted(meta[kind].items()):
            lines.append(f"  {kind} {name}: {tuple(e['shape'])} {e['dtype']}, {len(e['shards'])} shard(s)")
    return "\n".join(lines)


def export_hf(directory, out, dtype: str = "float32") -> Path:
    """Write the weights of the checkpoint at ``directory`` as a Hugging Face directory ``out``
    (GPT-2: ``GPT2LMHeadModel``; Llama-style: ``LlamaForCausalLM``; Mixtral-style:
    ``MixtralForCausalLM``), tensor by tensor, with the
    tokenizer of the dataset it was trained on; it appears complete (written beside it, then
    renamed)."""

    meta = verify_checkpoint(directory)
    reader = CheckpointReader(meta["path"], verify=False)
    cfg = config_from_dict(meta["extra"]["model_config"])
    if cfg.model_type in HF_FAMILIES:
        config_dict, param_shapes_of, hf_tensors = HF_FAMILIES[cfg.model_type]
        config = config_dict(cfg, dtype)
        for name, shape in param_shapes_of(cfg).items():
            reader.entry("params", name, shape)
        items = [(name, shape, dtype, fn) for name, shape, fn in hf_tensors(cfg, lambda n: reader.read("params", n))]
    else:
        config = hf_config_dict(cfg, dtype)  # refuses what is neither GPT-2 nor a family above
        shapes = param_shapes(cfg)
        for name, shape in shapes.items():
            reader.entry("params", name, shape)
        items = [(PREFIX + name, shape, dtype, lambda name=name: reader.read("params", name))
                 for name, shape in shapes.items()]
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"export: {out} exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write_safetensors(tmp / SINGLE_FILE, items)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        try:   # best effort: the weights export without it (the dataset may not be on this machine)
            save_hf_tokenizer((meta.get("extra") or {})["data"], tmp, cfg.n_positions)
        except (KeyError, ValueError, OSError) as err:
            print(f"export: warning: no tokenizer written ({err}); AutoTokenizer will not load from {out}",
                  file=sys.stderr)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpirt.checkpoint", description=__doc__.split("\n\n")[1])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="describe a checkpoint").add_argument("dir")
    export = sub.add_parser("export", help="write a Hugging Face directory (GPT-2, Llama or Mixtral, as the model is)")
    export.add_argument("dir")
    export.add_argument("out")
    export.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            print(info(args.dir), flush=True)
        else:
            print(f"exported {export_hf(args.dir, args.out, args.dtype)}", flush=True)
    except BrokenPipeError:   # the reader left (`| head`): not an error; nothing more to write
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (CheckpointError, OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
