"""The PyTorch reference the benchmarks race against: a GPT-2 of the same shape as mpirt's
(pre-norm blocks, tanh GELU, learned positions, tied head) with
``F.scaled_dot_product_attention(is_causal=True)``: what a PyTorch user would write in eager mode."""
from __future__ import annotations


def torch_gpt(cfg, device="cpu", init_std: float | None = None):
    """A PyTorch GPT-2 for ``cfg`` (n_embd, n_head, hidden, n_layer, vocab_size, n_positions) whose
    ``forward(idx, targets)`` returns the mean cross-entropy (in float32 under autocast). Seeded
    with 0; ``init_std`` draws every matrix from N(0, init_std) instead of PyTorch's defaults."""
    import torch
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            c = cfg.n_embd
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
            self.c_attn, self.c_proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
            self.c_fc, self.m_proj = torch.nn.Linear(c, cfg.hidden), torch.nn.Linear(cfg.hidden, c)

        def forward(self, h):
            b, t, c = h.shape
            q, k, v = self.c_attn(self.ln_1(h)).split(c, dim=2)
            q, k, v = (z.view(b, t, cfg.n_head, c // cfg.n_head).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            h = h + self.c_proj(a)
            return h + self.m_proj(F.gelu(self.c_fc(self.ln_2(h)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = torch.nn.Embedding(cfg.n_positions, cfg.n_embd)
            self.h = torch.nn.ModuleList(Block() for _ in range(cfg.n_layer))
            self.ln_f = torch.nn.LayerNorm(cfg.n_embd)
            if init_std is not None:
                for p in self.parameters():
                    if p.ndim >= 2:
                        torch.nn.init.normal_(p, std=init_std)

        def forward(self, idx, targets):
            h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                h = block(h)
            logits = self.ln_f(h) @ self.wte.weight.T
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))

    torch.manual_seed(0)
    return GPT().to(device)
