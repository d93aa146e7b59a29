"""The planner against published results: ZeRO's memory table, Megatron-LM's SC21 table 1 and the
pipeline bubbles of 1F1B / interleaved / ZB-H1 at p = 8, m = 32 (mpirt.plan.published).

    python bench/plan_published.py [--search-max-gpus 512]

Pure model (no MPI, no timing): writes bench/results/planner_published.md (cited by docs/planner.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpirt.plan import published as P  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search-max-gpus", type=int, default=512, help="run the planner's search for rows up to this")
    ap.add_argument("--gpu", default="a100")
    a = ap.parse_args()
    md = ["# The planner against published results", "",
          f"`python bench/plan_published.py` ({time.strftime('%Y-%m-%d')}); pure model, no measurement.", ""]

    md += ["## ZeRO: model-state memory per device, 7.5B parameters on 64 GPUs (Rajbhandari et al., SC20, Fig. 1)", "",
           "| stage | paper GB | mpirt.plan.memory.predict GB (7.47B GPT) | err | bytes_per_parameter at 7.5B | err | "
           "mpirt's ZeRO-2 backward transient GB |", "|---|---|---|---|---|---|---|"]
    for r in P.zero_table():
        md.append(f"| {r['stage']} | {r['paper_gb']} | {r['model_gb']:.2f} | {r['model_err_pct']:+.2f}% | "
                  f"{r['exact_psi_gb']:.2f} | {r['exact_err_pct']:+.2f}% | {r['transient_gb']:.1f} |")

    md += ["", "## Pipeline bubble at p = 8, m = 32 (unit costs: F = 1, B = 2; split: F = B = W = 1)", "",
           "| schedule | simulated (idle / total) | theory (idle / total) | simulated (idle / ideal) | "
           "paper (idle / ideal) | peak stash |", "|---|---|---|---|---|---|"]
    for r in P.bubble_table(8, 32):
        name = r["schedule"] + (f" v={r['chunks']}" if r["chunks"] > 1 else "")
        md.append(f"| {name} | {100 * r['simulated']:.2f}% | {100 * r['theory']:.2f}% | "
                  f"{100 * r['simulated_over_ideal']:.2f}% | {100 * r['paper_over_ideal']:.2f}% | {r['peak_stash']} |")

    md += ["", "## The largest published layouts on 80 GB GPUs: mpirt's predicted peak of the largest rank", "",
           "| model | layout | schedule, recompute | params | largest rank (stage) | GiB | of which activations | "
           "block sbh (SP + selective) | paper 34/t |", "|---|---|---|---|---|---|---|---|---|"]
    for r in P.frontier_rows():
        lay = r["layout"]
        md.append(f"| {r['name']} | tp {lay['tp']} pp {lay['pp']} dp {lay['dp']} | {r['schedule']}, {r['recompute']} | "
                  f"{r['params_b']:.0f}B | {r['stage']} | {r['peak_gib']:.1f} | {r['categories_gib']['activations']:.1f} | "
                  f"{r['block_sbh']:.3f} | " + (f"{r['paper_block_sbh']:.3f}" if r["paper_block_sbh"] else "-") + " |")
    md += ["", "bfloat16, micro-batches of one sequence, GPU process baseline left out; per-row statistics "
           "(8/h sbh) are mpirt's only bytes above the paper's."]

    md += ["", "## Published layouts in the planner's ranking (Korthikanti et al. 2022; A100 80 GB, 2048 tokens, "
           "SP + selective recomputation)", "",
           "| model | GPUs | batch | published layout | its place (feasible) | its layout as planned | step over #1 | "
           "predicted MFU | paper MFU | err | planner's #1 (MFU) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, *_ in P.KORTHIKANTI:
        r = P.korthikanti_row(name)
        md.append(f"| {name} | {r['gpus']} | {r['batch']} | {r['published']} | #{r['place']} ({r['feasible']}) | "
                  f"{r.get('layout', 'does not fit')} | {r.get('ratio', float('nan')):.3f} | {100 * r.get('mfu', 0):.1f}% | "
                  f"{100 * r['paper_mfu']:.1f}% | {100 * (r.get('mfu', 0) - r['paper_mfu']) / r['paper_mfu']:+.0f}% | "
                  f"{r['best']} ({100 * r['best_mfu']:.1f}%) |")
    md += ["", "## Llama 3 405B, the published layout (tp 8, pp 16, interleaved, no recomputation, SP; ZeRO-1), H100",
           "", "| GPUs | layout | step s | bubble s | predicted MFU | paper MFU | err | largest rank GiB |",
           "|---|---|---|---|---|---|---|---|"]
    for r in P.llama3_rows():
        md.append(f"| {r['gpus']} | {r['layout']} | {r['step_s']:.2f} | {r['bubble_s']:.2f} | {100 * r['mfu']:.1f}% | "
                  f"{100 * r['paper_mfu']:.0f}% | {100 * (r['mfu'] - r['paper_mfu']) / r['paper_mfu']:+.0f}% | "
                  f"{r['peak_gib']:.1f} |")
    r = P.mixtral_row()
    md += ["", f"## Mixtral 8x22B on {r['gpus']} H100 ({r['batch']} x {r['seq']} tokens; MoE Parallel Folding paper: "
           f"{100 * r['paper_mfu']:.1f}% MFU)", "",
           "| planner's #1 | MFU | best with ep > 1 | MFU | its ep all-to-all s / step s |", "|---|---|---|---|---|",
           f"| {r['best']} | {100 * r['best_mfu']:.1f}% | {r['best_ep']} | {100 * (r['best_ep_mfu'] or 0):.1f}% | "
           f"{r['best_ep_comm_s'] or 0:.2f} / {r['best_ep_step_s'] or 0:.2f} |"]
    r = P.deepseek_like_row()
    md += ["", f"## A DeepSeek-V3-like fine-grained MoE (256 experts, top-8) in DeepSeek-V3's layout on {r['gpus']} "
           "H100 (no published MFU)", "", "| layout | step s | exposed all-to-all s | predicted MFU | largest rank GiB |",
           "|---|---|---|---|---|", f"| {r['layout']} | {r['step_s']:.1f} | {r['ep_s']:.1f} | {100 * r['mfu']:.1f}% | "
           f"{r['peak_gib']:.0f} |"]

    rows = []
    for i, row in enumerate(P.MEGATRON):
        saved = P.MEGATRON
        P.MEGATRON = [row]
        try:
            rows += P.megatron_rows(a.gpu, search=row[6] <= a.search_max_gpus)
        finally:
            P.MEGATRON = saved
    md += ["", "## Megatron-LM, Narayanan et al. SC21 table 1 (A100 80 GB; TFLOP/s per GPU as the paper counts)", "",
           "| params | paper layout | GPUs | batch | paper TFLOP/s (% peak) | predicted, 1F1B | predicted, interleaved "
           "v=2 | err (best of the two) | predicted peak GiB | bottleneck | planner's pick (same GPUs, batch) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        preds = [r[k] for k in ("pred_tflops_1f1b", "pred_tflops_interleaved") if k in r]
        best = max(preds)
        md.append(f"| {r['params_b']}B | {r['layout']} | {r['gpus']} | {r['batch']} | {r['paper_tflops']} "
                  f"({r['paper_pct']}%) | {r.get('pred_tflops_1f1b', float('nan')):.0f} | "
                  + (f"{r['pred_tflops_interleaved']:.0f}" if "pred_tflops_interleaved" in r else "-") + " | "
                  f"{100 * (best - r['paper_tflops']) / r['paper_tflops']:+.0f}% | "
                  f"{r.get('pred_mem_gib_1f1b', 0):.1f} | {r.get('bottleneck_1f1b')} | "
                  + (f"{r['planner_best']} ({1e3 * r['planner_step_s']:.0f} ms/step against "
                     f"{1e3 * P.megatron_flops(r['batch'], 2048, *r['shape']) / (best * 1e12 * r['gpus']):.0f} for the "
                     f"paper's layout)" if "planner_best" in r else "not searched") + " |")
    md += ["", "Assumptions: micro-batches of one sequence, full activation recomputation (as the paper ran), "
           "bfloat16, the `a100` preset (75% GEMM efficiency, 20 us per autograd Function, NVLink 240 GB/s and "
           "InfiniBand 20 GB/s effective per GPU). The planner's pick minimises mpirt's predicted step time under "
           "mpirt's memory model (micro-batches of up to 4 sequences)."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_published.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
