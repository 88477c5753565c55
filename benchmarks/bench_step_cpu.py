"""One-process CPU training step: tessera's Trainer against plain torch on the same weights.

Plain torch is the model written directly (F.scaled_dot_product_attention, F.rms_norm, F.cross_entropy,
torch.nn.utils.clip_grad_norm_, AdamW) with tessera's initial weights loaded. Both take the same batch;
their steps are timed interleaved (tessera, plain, tessera, ...) in one process, so machine noise hits
both alike. The ratio is the median tessera step time over the median plain step time (1.0 = parity).

    python benchmarks/bench_step_cpu.py --model small --seq-lens 256,1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_results  # noqa: E402

from tessera.config import Config  # noqa: E402
from tessera.trainer import Trainer  # noqa: E402


class PlainBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv, ffn, eps):
        super().__init__()
        hd = dim // n_heads
        self.n_heads, self.n_kv, self.hd, self.eps = n_heads, n_kv, hd, eps
        self.attention_norm, self.ffn_norm = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.wq, self.wk = nn.Linear(dim, n_heads * hd, bias=False), nn.Linear(dim, n_kv * hd, bias=False)
        self.wv, self.wo = nn.Linear(dim, n_kv * hd, bias=False), nn.Linear(n_heads * hd, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, D = x.shape
        h = F.rms_norm(x, (D,), self.attention_norm, self.eps)
        q = self.wq(h).view(B, S, self.n_heads, self.hd).transpose(1, 2)
        k = self.wk(h).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        v = self.wv(h).view(B, S, self.n_kv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))
        h = F.rms_norm(x, (D,), self.ffn_norm, self.eps)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class PlainLlama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(
            PlainBlock(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.norm_eps) for _ in range(cfg.n_layers)
        )
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, tokens):
        S = tokens.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(F.rms_norm(h, (h.shape[-1],), self.norm, self.cfg.norm_eps))

    def load_tessera(self, state):
        own = {}
        for name, value in state.items():
            name = name.replace("attention.", "").replace("feed_forward.", "").replace(".weight", "")
            own[name] = value
        mapped = {}
        for name in self.state_dict():
            key = name.replace(".weight", "")
            mapped[name] = own[key]
        self.load_state_dict(mapped)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--seq-lens", default="256,1024")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step (batch = tokens / seq_len)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    store = tempfile.mktemp(prefix="tessera-bench-")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    rows = []
    try:
        for seq in map(int, args.seq_lens.split(",")):
            batch = max(1, args.tokens // seq)
            config = Config.create(
                model=args.model, seq_len=seq, global_batch=batch, steps=args.steps * 2 + 2, warmup=1, quiet=True
            )
            trainer = Trainer(config, torch.device("cpu"))
            plain = PlainLlama(trainer.model_config)
            plain.load_tessera({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
            o = config.optimizer
            opt = torch.optim.AdamW(
                plain.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
            )
            inputs, targets = trainer.data.global_batch_at(0)

            def plain_step():
                logits = plain(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
                torch.nn.utils.clip_grad_norm_(plain.parameters(), o.max_grad_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss.item()

            # the same first loss: the same weights and batch
            first_plain = F.cross_entropy(plain(inputs).flatten(0, 1), targets.flatten()).item()
            times = {"tessera": [], "plain": []}
            first_tessera = None
            for i in range(args.steps + args.warmup):
                t = time.perf_counter()
                rec = trainer.train_step().record()
                dt_tessera = time.perf_counter() - t
                first_tessera = rec["loss"] if first_tessera is None else first_tessera
                t = time.perf_counter()
                plain_step()
                dt_plain = time.perf_counter() - t
                if i >= args.warmup:
                    times["tessera"].append(dt_tessera)
                    times["plain"].append(dt_plain)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(
                seq_len=seq,
                batch=batch,
                tessera_step_s=med["tessera"],
                plain_step_s=med["plain"],
                ratio=med["tessera"] / med["plain"],
                first_loss_tessera=first_tessera,
                first_loss_plain=first_plain,
                steps_timed=args.steps,
            )
            rows.append(row)
            print(
                f"seq {seq:>5} batch {batch:>3}: tessera {med['tessera'] * 1e3:8.1f} ms  plain torch "
                f"{med['plain'] * 1e3:8.1f} ms  ratio {row['ratio']:.3f}x  (first loss {first_tessera:.6f} vs "
                f"{first_plain:.6f})",
                flush=True,
            )
    finally:
        dist.destroy_process_group()
    path = write_results(f"step-{args.model}-cpu", vars(args), {"rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
