"""Correctness parts of bench/gpu_check.py: every exported op, AdamW and a full GPT step on the device
backend (CuPy; NumPy in the ``--cpu`` dry run) in float64, float32 and bfloat16, against NumPy float64
run from the same inputs rounded to the checked dtype.

The op table mirrors tests/test_ops.py's CASES (same ops, shapes and argument kinds) with its
constants made on the active backend at call time, plus a few GPU-sized cases; dropout masks (one
backend's generator each) are recorded on the device and replayed in the reference. Float64 also
runs the finite-difference gradient check of :mod:`mpirt.core.testing` on the device.
"""
from __future__ import annotations

import time
import zlib
from contextlib import contextmanager

import numpy as np

import mpirt.core.backend as B
from gpu_check import fmt_err, rel_err, save, select, short_error, verdict
from mpirt.core.testing import normal, op_cases

DTYPES = ("float64", "float32", "bfloat16")
TOL = {"float64": 1e-10, "float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


def all_cases(big: bool) -> dict:
    """name -> (op name in ops.__all__, function of Tensors, input arrays, finite-difference check)."""
    from mpirt.core import ops
    from mpirt.core.ops.rotary import rotary_tables

    def rot(qkv, t, d):
        return ops.rotary_embedding(qkv, *rotary_tables(t, d, 10.0, B.xp.dtype(qkv.dtype)))

    cases = {k: (*v, True) for k, v in op_cases().items()}  # the op tests' own table
    # larger cases (GPU-sized on the device, small in the dry run): kernels past the toy shapes
    n, c, t, v = (4096, 1024, 256, 32768) if big else (64, 32, 16, 96)
    big_cases = {
        "matmul_large": ("matmul", lambda a, b: a @ b, [normal(n // 4, c), normal(c, 3 * c // 4, seed=1)]),
        "linear_large": ("linear", lambda x, w, b: ops.linear(x, w, b),
                         [normal(2, n // 8, c), normal(c, c, seed=1) / c ** 0.5, normal(c, seed=2)]),
        "gelu_large": ("gelu", lambda x: ops.gelu(x), [2 * normal(n // 8, c)]),
        "swiglu_large": ("swiglu", lambda a, b: ops.swiglu(a, b), [2 * normal(n // 8, c), normal(n // 8, c, seed=1)]),
        "softmax_large": ("softmax", lambda x: ops.softmax(x), [3 * normal(n // 8, c)]),
        "layer_norm_large": ("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b),
                             [normal(4, n // 8, c), 1 + 0.1 * normal(c, seed=1), normal(c, seed=2)]),
        "rms_norm_large": ("rms_norm", lambda x, w: ops.rms_norm(x, w, eps=1e-5), [normal(4, n // 8, c), 1 + 0.1 * normal(c, seed=1)]),
        "embedding_large": ("embedding",
                            lambda w: ops.embedding(B.xp.asarray(np.random.default_rng(3).integers(0, v, (4, n // 4))), w),
                            [normal(v, c // 4)]),
        "cross_entropy_large": ("cross_entropy", lambda x, y: ops.cross_entropy(x, y),
                                [2 * normal(n // 8, v), np.random.default_rng(4).integers(0, v, n // 8)]),
        "attention_large": ("causal_self_attention", lambda qkv: ops.causal_self_attention(qkv, n_head=8),
                            [normal(2, t, 3 * c // 2)]),
        "rotary_large": ("rotary_embedding", lambda qkv: rot(qkv, t, c // 16), [normal(2, t, 3 * c // 2)]),
        "dropout_large": ("dropout", lambda x: ops.dropout(x, 0.1, seed=11), [normal(n // 8, c)]),
        "sum_large": ("sum", lambda a: a.sum(axis=-1), [normal(n // 8, c)]),
    }
    cases.update({k: (*val, False) for k, val in big_cases.items()})
    return cases


# --- dropout masks: recorded on the device, replayed in the reference ----------------------------------
class MaskTape:
    """Patches ``dropout_mask`` where the ops read it: ``record()`` keeps each mask the device draws
    (as a host array), ``replay()`` hands them back in order to the reference run."""

    def __init__(self):
        import importlib
        attention = importlib.import_module("mpirt.core.ops.attention")
        dropout = importlib.import_module("mpirt.core.ops.dropout")   # (mpirt.core.ops.dropout the name is the function)
        self.modules, self.original, self.masks = (attention, dropout), dropout.dropout_mask, []

    @contextmanager
    def _patched(self, fn):
        for m in self.modules:
            m.dropout_mask = fn
        try:
            yield
        finally:
            for m in self.modules:
                m.dropout_mask = self.original

    def record(self):
        self.masks = []

        def fn(shape, p, seed):
            mask = self.original(shape, p, seed)
            self.masks.append(B.to_host(mask))
            return mask
        return self._patched(fn)

    def replay(self):
        queue = list(self.masks)
        return self._patched(lambda shape, p, seed: B.xp.asarray(queue.pop(0)))


def host(a) -> np.ndarray:
    """A host copy of ``a`` (``B.to_host`` returns a NumPy array itself, which updates in place
    would then change)."""
    return np.array(B.to_host(a), copy=True)


def is_float(a) -> bool:
    from mpirt.core.precision import is_half
    return a.dtype.kind == "f" or is_half(a.dtype)


def run_case(fn, arrays, seed_grad_of):
    """``(output, input gradients)`` as host arrays, on the active backend; ``seed_grad_of(out)``
    gives the backward's seed (a host array)."""
    from mpirt.core import ops
    from mpirt.core.tensor import Tensor
    tensors = [Tensor(B.asarray(a), requires_grad=is_float(a)) for a in arrays]
    out = fn(*tensors)
    if isinstance(out, list):
        out = ops.concat([p.reshape(-1) for p in out], axis=0)
    seed = seed_grad_of(out)
    out.backward(B.asarray(seed))
    grads = [B.to_host(t.grad) if t.grad is not None else np.zeros(t.shape) for t in tensors if t.requires_grad]
    return B.to_host(out.data), grads, seed


def check_case(fn, inputs, dtype, cpu, tape, seed):
    """Worst relative errors ``(forward, backward)`` of one case in ``dtype`` on the device."""
    arrays = [a.astype(dtype) if a.dtype.kind == "f" else a for a in inputs]
    rng = np.random.default_rng(seed)
    select(cpu)
    with tape.record():
        out, grads, seed_grad = run_case(fn, arrays, lambda o: rng.standard_normal(o.shape).astype(o.dtype))
    B.select("numpy")
    ref_in = [a.astype(np.float64) if is_float(a) else a for a in arrays]
    with tape.replay():
        ref, ref_grads, _ = run_case(fn, ref_in, lambda o: seed_grad.astype(np.float64))
    return rel_err(out, ref), max((rel_err(g, r) for g, r in zip(grads, ref_grads)), default=0.0)


def part_ops(args) -> None:
    from mpirt.core import ops
    from mpirt.core.testing import gradcheck
    t0, cases, tape = time.time(), all_cases(not args.cpu), MaskTape()
    per_op, data = {}, {}
    for name, (op, fn, inputs, small) in cases.items():
        entry = data[name] = {"op": op}
        for dtype in DTYPES:
            try:
                fwd, bwd = check_case(fn, inputs, dtype, args.cpu, tape, zlib.crc32(name.encode()))
                entry[dtype] = [fwd, bwd]
            except Exception as err:  # noqa: BLE001 - a failing op is a finding, the others go on
                entry[dtype] = short_error(err)
        if small:
            try:
                select(args.cpu)
                gradcheck(lambda *ts, fn=fn: _concat(fn(*ts)), *inputs)
                entry["gradcheck"] = "ok"
            except Exception as err:  # noqa: BLE001
                entry["gradcheck"] = short_error(err)
        per_op.setdefault(op, []).append(name)
    rows = []
    for op in ops.__all__:
        names = per_op.get(op, [])
        worst, errors, ok = {}, [], bool(names)
        for name in names:
            e = data[name]
            for dtype in DTYPES:
                if isinstance(e[dtype], str):
                    errors.append(f"{name} {dtype}: {e[dtype]}")
                    ok = False
                    continue
                w = max(e[dtype])
                worst[dtype] = max(worst.get(dtype, 0.0), w)
                ok &= w <= TOL[dtype]
            if e.get("gradcheck", "ok") != "ok":
                errors.append(f"{name} gradcheck: {e['gradcheck']}")
                ok = False
        result = " · ".join(f"{d} {fmt_err(worst[d])}" for d in DTYPES if d in worst)
        result += f"; {len(names)} case(s), f64 finite differences {'ok' if not any('gradcheck' in x for x in errors) else 'FAIL'}"
        if errors:
            result += "; " + "; ".join(errors[:2])
        rows.append(["ops", op, result if names else "no case covers this op", verdict(ok)])
    covered = set(per_op) - set(ops.__all__)
    if covered:
        rows.append(["ops", "cases naming unknown ops", ", ".join(sorted(covered)), "FAIL"])
    save(args.work, "ops", rows, {"cases": data, "tolerances": TOL}, t0)


def _concat(out):
    from mpirt.core import ops
    return ops.concat([p.reshape(-1) for p in out], axis=0) if isinstance(out, list) else out


# --- AdamW ---------------------------------------------------------------------------------------------
def adamw_reference(p, g, m, v, step, lr, b1, b2, eps, wd):
    """torch.optim.AdamW's update in float64, written out (independent of mpirt.core.optim)."""
    p = p * (1.0 - lr * wd)
    m[...] = b1 * m + (1 - b1) * g
    v[...] = b2 * v + (1 - b2) * g * g
    return p - lr * (m / (1 - b1 ** step)) / (np.sqrt(v / (1 - b2 ** step)) + eps)


def part_optim(args) -> None:
    from mpirt.core.nn import Parameter
    from mpirt.core.optim import AdamW, global_grad_norm
    from mpirt.core.precision import is_half
    t0, rows, data = time.time(), [], {}
    shapes = [(1024, 1536), (1536,), (4096, 256)] if not args.cpu else [(48, 80), (80,), (128, 24)]
    hyper = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, wd=0.1)
    for dtype in (*DTYPES, "float16"):
        try:
            rng = np.random.default_rng(1)
            scale = 1024.0 if dtype == "float16" else 1.0   # a loss scale undone through grad_scale
            init = [(0.5 * rng.standard_normal(s)).astype(dtype) for s in shapes]
            select(args.cpu)
            params = []
            for i, a in enumerate(init):
                p = Parameter(a.shape, dtype=dtype)
                p.data, p.name = B.asarray(a).copy(), f"p{i}"   # a copy: NumPy's asarray would alias
                params.append(p)
            opt = AdamW(params, lr=hyper["lr"], betas=(hyper["b1"], hyper["b2"]), eps=hyper["eps"],
                        weight_decay=hyper["wd"])
            opt.grad_scale = 1.0 / scale
            ref = [a.astype(np.float64) for a in init]
            state = [(np.zeros(s), np.zeros(s)) for s in shapes]
            norm_err = 0.0
            for step in (1, 2, 3):
                grads = [(1e-2 * scale * rng.standard_normal(s)).astype(dtype) for s in shapes]
                for p, g in zip(params, grads):
                    p.grad = B.asarray(g)
                norm = global_grad_norm(params)
                want = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads)))
                norm_err = max(norm_err, abs(norm - want) / want)
                opt.step()
                for i, (g, (m, v)) in enumerate(zip(grads, state)):
                    ref[i] = adamw_reference(ref[i], g.astype(np.float64) / scale, m, v, step, hyper["lr"], hyper["b1"],
                                             hyper["b2"], hyper["eps"], hyper["wd"] if ref[i].ndim >= 2 else 0.0)
            got = [host(opt.master[i] if opt.master[i] is not None else p.data) for i, p in enumerate(params)]
            update = rel_err(np.concatenate([(g.astype(np.float64) - a.astype(np.float64)).ravel() for g, a in zip(got, init)]),
                             np.concatenate([(r - a.astype(np.float64)).ravel() for r, a in zip(ref, init)]))
            rounded = all(np.array_equal(B.to_host(p.data), B.to_host(opt.master[i]).astype(dtype))
                          for i, p in enumerate(params)) if is_half(dtype) else True
            tol = TOL["float64"] if dtype == "float64" else 1e-4   # masters and moments are float32 for half
            ntol = TOL["float64"] if dtype == "float64" else 1e-5
            ok = update <= tol and norm_err <= ntol and rounded
            data[dtype] = {"update_rel_err": update, "norm_rel_err": norm_err, "half_is_rounded_master": rounded}
            what = "float32 masters" if is_half(dtype) else "parameters"
            rows.append(["optim", f"AdamW {dtype}", f"3 steps, update of the {what}: rel err {fmt_err(update)}; "
                         f"global_grad_norm rel err {fmt_err(norm_err)}"
                         + ("; half weights = rounded masters" if is_half(dtype) and rounded else "")
                         + ("; grad_scale 1/1024" if scale != 1 else ""), verdict(ok)])
        except Exception as err:  # noqa: BLE001
            rows.append(["optim", f"AdamW {dtype}", short_error(err), "FAIL"])
            data[dtype] = short_error(err)
    save(args.work, "optim", rows, data, t0)


# --- a full GPT step -----------------------------------------------------------------------------------
def gpt_step(cfg, dtype, x, y, init=None):
    """Build a GPT (weights ``init`` by name if given), run forward, backward, clip at 1.0 and one
    AdamW step on the active backend; return host copies of what the check compares."""
    from mpirt.core.modeling import build_model
    from mpirt.core.optim import AdamW, clip_grad_norm
    model = build_model(cfg, dtype=dtype, seed=0)
    named = dict(model.named_parameters())
    if init is not None:
        for name, p in named.items():
            p.data[...] = B.asarray(init[name].astype(np.float64), dtype=p.dtype)
    before = {n: host(p.data) for n, p in named.items()}
    opt = AdamW(list(named.values()), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    opt.zero_grad()
    _, loss = model(B.asarray(x), B.asarray(y))
    loss.backward()
    grads = {n: host(p.grad) for n, p in named.items()}
    norm = clip_grad_norm(list(named.values()), 1.0)
    opt.step()
    after = {n: host(opt.master[i] if opt.master[i] is not None else p.data)
             for i, (n, p) in enumerate(named.items())}
    return {"loss": float(loss.item()), "grads": grads, "before": before, "after": after, "norm": norm}


def part_gpt(args) -> None:
    from mpirt.models.model_config import GPTConfig
    t0, rows, data = time.time(), [], {}
    if args.cpu:
        cfg, batch, seq = GPTConfig(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=96), 2, 16
    else:
        cfg, batch, seq = GPTConfig(n_layer=2, n_head=4, n_embd=256, n_positions=128, vocab_size=2048), 4, 128
    rng = np.random.default_rng(5)
    x, y = (rng.integers(0, cfg.vocab_size, (batch, seq)) for _ in range(2))
    tol = {"float64": (1e-10, 1e-9, 1e-8), "float32": (1e-5, 1e-3, 1e-3), "bfloat16": (2e-2, 1e-1, 2e-1)}
    for dtype in DTYPES:
        try:
            select(args.cpu)
            dev = gpt_step(cfg, dtype, x, y)
            B.select("numpy")
            ref = gpt_step(cfg, "float64", x, y, init=dev["before"])
            names = list(ref["grads"])
            loss_err = abs(dev["loss"] - ref["loss"]) / abs(ref["loss"])
            grad_err = rel_err(np.concatenate([dev["grads"][n].astype(np.float64).ravel() for n in names]),
                               np.concatenate([ref["grads"][n].ravel() for n in names]))
            worst = max(names, key=lambda n: rel_err(dev["grads"][n], ref["grads"][n]))
            upd = [(dev["after"][n].astype(np.float64) - dev["before"][n].astype(np.float64)).ravel() for n in names]
            upd_ref = [(ref["after"][n] - ref["before"][n]).ravel() for n in names]
            update_err = rel_err(np.concatenate(upd), np.concatenate(upd_ref))
            lt, gt, ut = tol[dtype]
            ok = loss_err <= lt and grad_err <= gt and update_err <= ut
            data[dtype] = {"loss": [dev["loss"], ref["loss"]], "loss_rel_err": loss_err, "grad_rel_err": grad_err,
                           "worst_param": [worst, rel_err(dev["grads"][worst], ref["grads"][worst])],
                           "update_rel_err": update_err, "norm": [dev["norm"], ref["norm"]]}
            rows.append(["gpt-step", f"GPT step {dtype}",
                         f"loss {dev['loss']:.4f} (rel err {fmt_err(loss_err)}), grads rel err {fmt_err(grad_err)} "
                         f"(worst {worst} {fmt_err(data[dtype]['worst_param'][1])}), AdamW update rel err "
                         f"{fmt_err(update_err)}; tolerances {lt:g}/{gt:g}/{ut:g}", verdict(ok)])
        except Exception as err:  # noqa: BLE001
            rows.append(["gpt-step", f"GPT step {dtype}", short_error(err), "FAIL"])
            data[dtype] = short_error(err)
    data["config"] = {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head, "vocab": cfg.vocab_size,
                      "batch": batch, "seq": seq}
    save(args.work, "gpt", rows, data, t0)
