"""PyTorch reference for `meshtrain bench train`: the same GPT (optionally with
mixture-of-experts blocks, --moe-experts: the same router, capacity, dispatch,
experts and combine as meshtrain/model/moe.cpp) or Llama (the llama3.2
presets: RMSNorm, RoPE, grouped keys and values, SwiGLU, tied head), optimizer, batch and
schedule, single process, DDP or FSDP2 (`fully_shard`, per block then the root),
over gloo; or one process on a GPU (--device cuda), eager or torch.compile'd,
in float32 or bfloat16 autocast. Launch one process per rank, e.g.
    torchrun --nproc_per_node=2 bench/reference/train_gpt.py --preset small [--fsdp]
    python bench/reference/train_gpt.py --preset gpt2-124m --device cuda --dtype bfloat16 [--compile]
Prints one JSON line on rank 0: median tokens/s over the timed steps and each
rank's memory (peak RSS, and its growth from just before the model is built;
on a GPU also the caching allocator's peak).
"""
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

PRESETS = {  # vocab, context, layers, heads, width — as meshtrain's presets
    "tiny": (256, 128, 4, 4, 256),
    "small": (256, 256, 6, 6, 384),
    "gpt2-124m": (50257, 1024, 12, 12, 768),
    "gpt2-350m": (50257, 1024, 24, 16, 1024),
}
# Llama-shaped presets: vocab, context, layers, heads, width, kv heads, MLP hidden, tied head — as meshtrain's.
LLAMA_PRESETS = {
    "llama3.2-1b": (128256, 131072, 16, 32, 2048, 8, 8192, True),
    "llama3.2-3b": (128256, 131072, 28, 24, 3072, 8, 8192, True),
}


class MoE(nn.Module):
    """Top-1 (Switch) or top-2 (GShard) experts of GELU MLPs: fp32 router, capacity
    ceil(n·k·cf/E) with first choices placed before second ones (cf 0: dropless),
    tokens grouped by expert, gated combine; Switch aux loss and router z-loss."""

    def __init__(self, width, experts, hidden, top_k, capacity_factor, second, aux_loss, z_loss):
        super().__init__()
        self.experts, self.top_k, self.capacity_factor, self.second = experts, top_k, capacity_factor, second
        self.aux_weight, self.z_weight = aux_loss, z_loss
        self.router = nn.Parameter(torch.empty(experts, width))
        self.fc_weight = nn.Parameter(torch.empty(experts, hidden, width))
        self.fc_bias = nn.Parameter(torch.zeros(experts, hidden))
        self.proj_weight = nn.Parameter(torch.empty(experts, width, hidden))
        self.proj_bias = nn.Parameter(torch.zeros(experts, width))
        self.aux = torch.zeros(())

    def forward(self, x):
        b, t, d = x.shape
        e, k = self.experts, self.top_k
        flat = x.reshape(-1, d)
        n = flat.size(0)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(flat.float(), self.router)
        probs = logits.softmax(-1)
        top, choice = probs.topk(k, dim=-1)
        gates, wanted = top, torch.ones_like(choice, dtype=torch.bool)
        if k == 2:
            gates = top / top.sum(-1, keepdim=True)
            if self.second == "random" and self.training:
                wanted[:, 1] = torch.rand(n, device=x.device) < (2 * gates[:, 1]).clamp(max=1.0).detach()
        expert_of, wanted_flat = choice.t().reshape(-1), wanted.t().reshape(-1)
        token_of, gate_of = torch.arange(n, device=x.device).repeat(k), gates.t().reshape(-1)
        one_hot = F.one_hot(expert_of, e) * wanted_flat.unsqueeze(1).long()
        position = (one_hot.cumsum(0) - 1).gather(1, expert_of.unsqueeze(1)).squeeze(1)
        capacity = math.ceil(n * k * self.capacity_factor / e) if self.capacity_factor > 0 else n * k
        selected = (wanted_flat & (position < capacity)).nonzero().squeeze(1)
        experts_selected = expert_of[selected]
        order = torch.sort(experts_selected, stable=True).indices
        tokens, token_gates = token_of[selected][order], gate_of[selected][order]
        counts = torch.bincount(experts_selected, minlength=e).tolist()
        outputs = []
        for xe, fw, fb, pw, pb in zip(flat[tokens].split(counts), self.fc_weight.unbind(0), self.fc_bias.unbind(0),
                                      self.proj_weight.unbind(0), self.proj_bias.unbind(0)):
            outputs.append(F.linear(F.gelu(F.linear(xe, fw, fb), approximate="tanh"), pw, pb))
        computed = torch.cat(outputs)
        weighted = computed * token_gates.unsqueeze(1).to(computed.dtype)
        out = torch.zeros(n, d, dtype=weighted.dtype, device=x.device).index_add(0, tokens, weighted)
        first_share = F.one_hot(choice[:, 0], e).float().mean(0)
        self.aux = (self.aux_weight * e * (first_share * probs.mean(0)).sum() +
                    self.z_weight * torch.logsumexp(logits, -1).pow(2).mean())
        return out.view(b, t, d)


class Block(nn.Module):
    def __init__(self, width, heads, moe=None):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.moe = moe
        if moe is None:
            self.fc = nn.Linear(width, 4 * width)
            self.fc_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        if self.moe is not None:
            return x + self.moe(self.norm2(x))
        return x + self.fc_proj(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, heads, width, moe=None, moe_every=1):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, moe() if moe and i % moe_every == moe_every - 1 else None)
                                    for i in range(layers))
        self.norm_f = nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if p.dim() >= 2 and not name.endswith("bias"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)
            elif "norm" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.size(1), device=tokens.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm_f(x), self.wte.weight)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return loss + sum((b.moe.aux for b in self.blocks if b.moe is not None), torch.zeros((), device=loss.device))


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """RoPE on the two halves of each head (the layout Hugging Face's Llama uses)."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class LlamaBlock(nn.Module):
    """Pre-norm block: RMSNorm, attention with grouped keys and values and RoPE, RMSNorm, SwiGLU; no biases."""

    def __init__(self, width, heads, kv_heads, hidden):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.attn_norm, self.mlp_norm = RMSNorm(width), RMSNorm(width)
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Grouped keys in the kernel where its flash path takes them (16-bit); fp32 would fall back to the math one.
        if GQA_IN_SDPA and q.dtype in (torch.bfloat16, torch.float16):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        else:  # older torch: the keys and values repeated per query head, as transformers' repeat_kv does
            times = self.heads // self.kv_heads
            y = F.scaled_dot_product_attention(q, k.repeat_interleave(times, 1), v.repeat_interleave(times, 1),
                                               is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


GQA_IN_SDPA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class Llama(nn.Module):
    """A Llama 3-style decoder (plain RoPE at theta 500,000: Llama 3's frequency scaling changes no work)."""

    def __init__(self, vocab, context, layers, heads, width, kv_heads, hidden, tied):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = None if tied else nn.Linear(width, vocab, bias=False)
        head_dim = width // heads
        inverse = 500000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(context, dtype=torch.float64), inverse)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens, targets):
        t = tokens.size(1)
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = F.linear(self.norm(x), self.embed.weight if self.head is None else self.head.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


ADDS_INTO = ("aten::addmm", "aten::addmm_", "aten::baddbmm")
PRODUCTS = ("aten::mm", "aten::bmm") + ADDS_INTO


def product_rows(events, steps):
    """The outermost matrix products summed by name and operand sizes, as
    meshtrain's products.json (without the peak, which this side does not measure)."""
    rows = {}
    for e in events:
        if e.name not in PRODUCTS or e.device_type != torch.autograd.DeviceType.CPU or e.time_range.elapsed_us() <= 0:
            continue
        parent, inner = e.cpu_parent, False
        while parent is not None and not inner:
            inner, parent = parent.name in PRODUCTS, parent.cpu_parent
        if inner:
            continue
        sizes = [list(s) for s in e.input_shapes][1 if e.name in ADDS_INTO else 0:][:2]
        batched = e.name in ("aten::bmm", "aten::baddbmm")
        rank = 3 if batched else 2
        flops = 0
        if len(sizes) == 2 and len(sizes[0]) == rank and len(sizes[1]) == rank:
            flops = 2 * (sizes[0][0] if batched else 1) * sizes[0][-2] * sizes[0][-1] * sizes[1][-1]
        key = (e.name, " x ".join("[" + ", ".join(map(str, s)) + "]" for s in sizes))
        calls, us, total = rows.get(key, (0, 0.0, 0))
        rows[key] = (calls + 1, us + e.time_range.elapsed_us(), total + flops)
    return [{"name": name, "operands": operands, "calls_per_step": calls / steps, "ms_per_step": us / 1e3 / steps,
             "gflop_per_step": flops / steps / 1e9, "gflops": flops / us / 1e3 if us > 0 else 0.0, "share_of_peak": None}
            for (name, operands), (calls, us, flops) in sorted(rows.items(), key=lambda kv: -kv[1][1])]


def profile_steps(directory, steps, train_step, writer):
    """Profiles `steps` steps: a Chrome trace and each operator's self time per step,
    in the format of `meshtrain bench train --profile` (ops.json)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), record_shapes=True) as prof:
        for s in range(steps):
            train_step(s)
    if not writer:
        return
    os.makedirs(directory, exist_ok=True)
    prof.export_chrome_trace(os.path.join(directory, "trace.json"))
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows)
    with open(os.path.join(directory, "ops.json"), "w") as f:
        json.dump([{"name": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
                    "share": e.self_cpu_time_total / total} for e in rows], f)
        f.write("\n")
    if not cuda:  # the matrix products by operand sizes, as meshtrain's products.json
        with open(os.path.join(directory, "products.json"), "w") as f:
            json.dump(product_rows(prof.events(), steps), f)
            f.write("\n")
    if cuda:  # the GPU's kernels, copies and fills by time on the device, as meshtrain's kernels.json
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and
                   not getattr(e, "is_user_annotation", False)]  # record_function's spans on the GPU are not work
        by_name = {}
        for e in kernels:
            calls, us = by_name.get(e.name, (0, 0.0))
            by_name[e.name] = (calls + 1, us + e.time_range.elapsed_us())
        total = sum(us for _, us in by_name.values()) or 1.0
        with open(os.path.join(directory, "kernels.json"), "w") as f:
            json.dump([{"name": name, "calls_per_step": calls / steps, "self_ms_per_step": us / 1e3 / steps,
                        "share": us / total} for name, (calls, us) in
                       sorted(by_name.items(), key=lambda kv: kv[1][1], reverse=True)], f)
            f.write("\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS) + sorted(LLAMA_PRESETS))
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="timed steps")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps first")
    parser.add_argument("--bucket-mb", type=int, default=25)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    parser.add_argument("--width", type=int, default=0, help="override the preset's width")
    parser.add_argument("--context", type=int, default=0, help="override the preset's context (tokens per sequence)")
    parser.add_argument("--vocab", type=int, default=0, help="override the preset's vocabulary size")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: autocast")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (default mode)")
    parser.add_argument("--moe-experts", type=int, default=0, help="experts per MoE block (0: dense)")
    parser.add_argument("--moe-every", type=int, default=1, help="every k-th block is MoE")
    parser.add_argument("--moe-top-k", type=int, default=1, choices=[1, 2])
    parser.add_argument("--moe-hidden", type=int, default=0, help="an expert's hidden size (0: 4 x width)")
    parser.add_argument("--moe-capacity-factor", type=float, default=1.25, help="0: dropless")
    parser.add_argument("--moe-second-expert", default="random", choices=["random", "always"])
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="after the timed steps, profile more: DIR/trace.json (Chrome trace) and DIR/ops.json")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--count-parameters", action="store_true",
                        help="print the model's parameter count as JSON and exit (built on the meta device: no memory)")
    args = parser.parse_args()
    device = torch.device(args.device)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // world)))))
    torch.manual_seed(1337)

    llama = LLAMA_PRESETS.get(args.preset)
    vocab, context, layers, heads, width = llama[:5] if llama else PRESETS[args.preset]
    layers, width = args.layers or layers, args.width or width
    vocab, context = args.vocab or vocab, args.context or context
    baseline_rss = rss_mib()
    moe = None
    if args.moe_experts:
        moe = lambda: MoE(width, args.moe_experts, args.moe_hidden or 4 * width, args.moe_top_k,  # noqa: E731
                          args.moe_capacity_factor, args.moe_second_expert, 0.01, 0.001)
    build = (lambda: Llama(vocab, context, layers, heads, width, *llama[5:])) if llama else \
        (lambda: GPT(vocab, context, layers, heads, width, moe, args.moe_every))
    if args.count_parameters:
        with torch.device("meta"):
            print(json.dumps({"preset": args.preset, "parameters": sum(p.numel() for p in build().parameters())}))
        return
    model = build().to(device)
    step_model = torch.compile(model) if args.compile else model
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        step_model = model
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    accumulation = args.batch // (args.micro_batch * world)
    assert accumulation * args.micro_batch * world == args.batch, "batch must divide by micro-batch x ranks"
    generator = torch.Generator().manual_seed(rank)

    def train_step(step, total):
        lr = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * step / total))
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=False)
        for micro in range(accumulation):
            tokens = torch.randint(0, vocab, (args.micro_batch, context + 1), generator=generator).to(device)
            sync = micro == accumulation - 1 or world == 1
            context_manager = model.no_sync() if (world > 1 and not sync and not args.fsdp) else torch.enable_grad()
            autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
            with context_manager:
                with autocast:
                    loss = step_model(tokens[:, :-1], tokens[:, 1:]) / accumulation
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.detach() * accumulation
        if world > 1:
            dist.all_reduce(loss_value, op=dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else dist.ReduceOp.SUM)
        loss_value.item()

    total = args.warmup_steps + args.steps
    seconds = []
    for step in range(total):
        start = time.perf_counter()
        train_step(step, total)
        if step >= args.warmup_steps:
            seconds.append(time.perf_counter() - start)
    if args.profile:
        profile_steps(args.profile, args.profile_steps, lambda s: train_step(total + s, total + args.profile_steps),
                      rank == 0)
    tokens_per_second = args.batch * context / statistics.median(seconds)
    memory = torch.tensor([peak_rss_mib(), peak_rss_mib() - baseline_rss], dtype=torch.float64)
    memories = [memory.clone() for _ in range(world)]
    if world > 1:
        dist.all_gather(memories, memory)
    if rank == 0:
        print(json.dumps({"side": "pytorch", "preset": args.preset, "ranks": world, "batch": args.batch,
                          "micro_batch": args.micro_batch, "threads": torch.get_num_threads(),
                          "tokens_per_s": tokens_per_second, "torch": torch.__version__,
                          "parameters": sum(p.numel() for p in model.parameters()),  # global sizes, DTensors too
                          "moe_experts": args.moe_experts, "moe_top_k": args.moe_top_k,
                          "peak_rss_mib": [m[0].item() for m in memories],
                          "rss_growth_mib": [m[1].item() for m in memories],
                          "device": args.device, "dtype": args.dtype, "compile": args.compile,
                          "device_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else 0}))
    sys.stdout.flush()
    if world > 1:
        # Leave without tearing the gloo process group down: with torch 2.11 that
        # teardown sometimes aborts ("terminate called without an active exception")
        # after the work is done.
        dist.barrier()
        os._exit(0)


if __name__ == "__main__":
    main()
