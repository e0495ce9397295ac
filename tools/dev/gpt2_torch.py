#!/usr/bin/python3
"""Independent PyTorch reference for fsdp-lua's GPT-2 model.

Run with Debian's system interpreter, which is the one that has torch:

    /usr/bin/python3 tools/dev/gpt2_torch.py --golden tests/fixtures
    /usr/bin/python3 tools/dev/gpt2_torch.py --golden-bf16 tests/fixtures
    /usr/bin/python3 tools/dev/gpt2_torch.py --bench --batch 4 --ctx 64 --threads 2
    /usr/bin/python3 tools/dev/gpt2_torch.py --bench --dtype bf16 --threads 2

The model is written from scratch here (no `transformers`), but its parameter
names and layouts follow Hugging Face's GPT-2 checkpoints exactly, so the
files written by this script can be loaded by anything that reads HF GPT-2
safetensors. In particular the linear layers are HF "Conv1D" layers, whose
weight is stored (in_features, out_features) and applied as `x @ W + b` --
the transpose of torch.nn.Linear's layout.

Safetensors files are read and written by the small helpers below (the
`safetensors` package is deliberately not used).

Modes:
  --golden OUTDIR   write the tiny-model golden fixtures (float64 reference,
                    stored as F32) used by the engine's golden test.
  --bench           time training steps (forward, backward, clip, AdamW)
                    for comparison with the engine's own benchmark; f32, or
                    with --dtype bf16 the forward under
                    torch.autocast("cpu", dtype=torch.bfloat16) (PyTorch's
                    fastest CPU mode: bf16 matmuls through oneDNN).
  --golden-bf16 OUTDIR
                    write gpt2_tiny_golden_bf16.safetensors: loss and
                    gradients of the tiny model at the same init weights and
                    batch with the forward under bf16 autocast.
"""

import argparse
import json
import math
import os
import resource
import struct
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

PRESETS = {
    # The golden-test model: ~30k parameters, small enough that the fixture
    # files stay tiny and the float64 reference runs in well under a second.
    "tiny": dict(vocab_size=300, n_layer=2, n_head=2, n_embd=32, block_size=16),
    # GPT-2 "small" (124M), the original OpenAI release.
    "small": dict(vocab_size=50257, n_layer=12, n_head=12, n_embd=768,
                  block_size=1024),
}

# Optimizer settings shared by the golden fixture and the benchmark.
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP_NORM = 1.0
LN_EPS = 1e-5
INIT_STD = 0.02


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------

class Conv1D(nn.Module):
    """HF GPT-2's affine layer: y = x @ weight + bias, weight is (in, out)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight
                           ).view(*x.shape[:-1], self.weight.shape[1])


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.n_head = cfg["n_head"]
        self.c_attn = Conv1D(C, 3 * C)   # fused q, k, v projection
        self.c_proj = Conv1D(C, C)       # output projection (residual)
        T = cfg["block_size"]
        # Lower-triangular mask: position t may attend to positions <= t.
        # A buffer, not a parameter, so it is not part of the state dict.
        self.register_buffer(
            "causal", torch.tril(torch.ones(T, T, dtype=torch.bool)),
            persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        nh = self.n_head
        hd = C // nh
        q, k, v = self.c_attn(x).split(C, dim=-1)          # order: q, k, v
        # (B, T, C) -> (B, nh, T, hd)
        q = q.view(B, T, nh, hd).transpose(1, 2)
        k = k.view(B, T, nh, hd).transpose(1, 2)
        v = v.view(B, T, nh, hd).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        scores = scores.masked_fill(~self.causal[:T, :T], float("-inf"))
        y = F.softmax(scores, dim=-1) @ v                   # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)              # merge heads
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.c_fc = Conv1D(C, 4 * C)
        self.c_proj = Conv1D(4 * C, C)   # residual projection

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C = cfg["n_embd"]
        self.ln_1 = nn.LayerNorm(C, eps=LN_EPS)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(C, eps=LN_EPS)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    """GPT-2 whose state_dict keys are exactly HF's (without the
    `transformer.` prefix): wte.weight, wpe.weight, h.{i}.*, ln_f.*.

    The LM head is tied to wte and has no parameter of its own, so the
    gradient of wte.weight includes both the embedding lookup and the head.
    """

    def __init__(self, cfg):
        super().__init__()
        assert cfg["n_embd"] % cfg["n_head"] == 0
        self.cfg = dict(cfg)
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.wpe = nn.Embedding(cfg["block_size"], cfg["n_embd"])
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(cfg["n_embd"], eps=LN_EPS)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        """GPT-2 init: N(0, 0.02) for matrices and embeddings; the two
        residual projections per block get N(0, 0.02/sqrt(2*n_layer)) so the
        residual stream's variance does not grow with depth; biases 0;
        LayerNorm weight 1, bias 0. Draws follow named_parameters() order,
        so a given torch.manual_seed always yields the same weights."""
        resid_std = INIT_STD / math.sqrt(2 * self.cfg["n_layer"])
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, resid_std)
            elif p.dim() >= 2:
                p.normal_(0.0, INIT_STD)
            elif "ln_" in name and name.endswith(".weight"):
                p.fill_(1.0)                  # LayerNorm gain
            else:
                p.zero_()                     # biases (Conv1D and LayerNorm)

    @torch.no_grad()
    def perturb(self, std=0.05):
        """Add N(0, std) noise to every 1-D parameter (biases and LayerNorm
        weights/biases). With the plain init those are 0/1 and several of
        their gradients would be degenerate; the golden test wants every
        gradient to carry signal."""
        for _, p in self.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * std)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        assert T <= self.cfg["block_size"], "sequence longer than block_size"
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)                   # (B, T, C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = x @ self.wte.weight.t()                    # tied LM head
        loss = None
        if targets is not None:
            # Mean over the targets that are not -100.
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]),
                                   targets.view(-1), ignore_index=-100)
        return logits, loss


def make_optimizer(model):
    """AdamW with weight decay only on parameters with dim >= 2 (all
    matrices and both embeddings); biases and LayerNorm params get none."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": ADAMW["weight_decay"]},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=ADAMW["betas"],
                             eps=ADAMW["eps"])


# --------------------------------------------------------------------------
# Minimal safetensors I/O
# --------------------------------------------------------------------------

_ST_DTYPES = {  # safetensors dtype name -> numpy little-endian dtype
    "F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4", "U16": "<u2",
    "F16": "<f2", "U8": "u1",
}


def _to_numpy(t):
    """Tensor -> (dtype name, contiguous little-endian numpy array)."""
    if t.dtype == torch.bfloat16:
        # numpy has no bf16: keep the raw 16 bits. (Not used by the fixtures.)
        bits = t.contiguous().view(torch.int16).numpy().astype("<u2")
        return "BF16", bits
    name = {torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
            torch.int32: "I32", torch.float16: "F16", torch.uint8: "U8"}[t.dtype]
    return name, np.ascontiguousarray(t.detach().cpu().numpy(),
                                      dtype=_ST_DTYPES[name])


def save_safetensors(path, tensors, metadata=None):
    """Write `tensors` (ordered dict name -> torch.Tensor) to `path`.

    Layout: u64 LE header length N, N bytes of JSON header (space-padded to
    a multiple of 8 so the data section is 8-byte aligned), then the raw
    tensors back to back in the order given. Output is byte-for-byte
    deterministic for the same inputs."""
    header = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        dtype, arr = _to_numpy(t)
        raw = arr.tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for raw in blobs:
            f.write(raw)
    os.replace(tmp, path)


def load_safetensors(path):
    """Read a safetensors file -> (dict name -> torch.Tensor, metadata),
    checking the header against the file's size."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} runs past the end of the file")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = memoryview(raw)[8 + n:]
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(data[b:e], dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(data[b:e], dtype=_ST_DTYPES[info["dtype"]])
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if arr.size != count or e > len(data):
            raise ValueError(f"{path}: tensor {name}: {arr.size} elements for shape {info['shape']}")
        out[name] = torch.from_numpy(arr.copy()).reshape(info["shape"])
    return out, meta


# --------------------------------------------------------------------------
# Golden fixtures
# --------------------------------------------------------------------------

GOLDEN_B, GOLDEN_T = 2, 16
SEED_INIT, SEED_DATA = 1234, 5678


def golden(outdir):
    cfg = PRESETS["tiny"]
    torch.manual_seed(SEED_INIT)
    model = GPT2(cfg)
    model.perturb(0.05)
    # The stored init weights are float32. Convert to float64 *after*
    # initialising in float32, so the float64 reference starts from exactly
    # the values in the init file.
    init_sd = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    model = model.double()

    g = torch.Generator().manual_seed(SEED_DATA)
    V, B, T = cfg["vocab_size"], GOLDEN_B, GOLDEN_T
    input_ids = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
    targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
    targets[0, 3] = -100       # two ignored positions, one per sequence
    targets[1, 11] = -100

    # One forward/backward for logits, loss and gradients.
    logits, loss = model(input_ids, targets)
    loss.backward()
    names = [n for n, _ in model.named_parameters()]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # 10 AdamW steps on the same batch.
    opt = make_optimizer(model)
    losses, norms = [], []
    for _ in range(10):
        opt.zero_grad(set_to_none=True)
        _, l = model(input_ids, targets)
        l.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), CLIP_NORM)))
        losses.append(float(l))
        opt.step()

    cfg_meta = {k: str(v) for k, v in cfg.items()}
    os.makedirs(outdir, exist_ok=True)
    save_safetensors(os.path.join(outdir, "gpt2_tiny_init.safetensors"),
                     {n: init_sd[n] for n in names},
                     dict(cfg_meta, seed=str(SEED_INIT),
                          note="GPT-2 init plus N(0,0.05) on biases/LayerNorm; "
                               "HF names, Conv1D (in,out) layout"))

    f32 = lambda t: t.detach().to(torch.float32)
    out = {"input_ids": input_ids, "targets": targets,
           "logits": f32(logits), "loss": f32(loss).reshape(1)}
    for n in names:
        out["grad." + n] = f32(grads[n])
    out["adamw_losses"] = torch.tensor(losses, dtype=torch.float32)
    out["grad_norms"] = torch.tensor(norms, dtype=torch.float32)
    final = dict(model.named_parameters())
    for n in names:
        out["final." + n] = f32(final[n])
    meta = dict(cfg_meta,
                batch=str(B), seq_len=str(T), ignore_index="-100",
                reference_dtype="float64",
                optimizer="AdamW (torch.optim.AdamW, decoupled weight decay)",
                lr=str(ADAMW["lr"]), beta1=str(ADAMW["betas"][0]),
                beta2=str(ADAMW["betas"][1]), eps=str(ADAMW["eps"]),
                weight_decay=str(ADAMW["weight_decay"]),
                weight_decay_on="params with dim>=2 (matrices, wte, wpe)",
                grad_clip_global_norm=str(CLIP_NORM),
                steps="10",
                adamw_losses="loss before each step's update",
                grad_norms="total grad L2 norm before clipping",
                generator="/usr/bin/python3 tools/dev/gpt2_torch.py --golden tests/fixtures")
    save_safetensors(os.path.join(outdir, "gpt2_tiny_golden.safetensors"),
                     out, meta)

    nparams = sum(p.numel() for p in model.parameters())
    print(f"tiny GPT-2: {nparams} params, loss={float(loss):.8f}")
    print("adamw_losses:", " ".join(f"{x:.8f}" for x in losses))
    print("grad_norms:  ", " ".join(f"{x:.6f}" for x in norms))
    print(f"wrote {outdir}/gpt2_tiny_init.safetensors, "
          f"{outdir}/gpt2_tiny_golden.safetensors")


def golden_bf16(outdir):
    """The same init weights and batch as golden(), forward and loss under
    bf16 autocast (f32 master weights; matmuls in bf16, LayerNorm, softmax
    and the loss in f32 as autocast does), one backward."""
    cfg = PRESETS["tiny"]
    init_sd, _ = load_safetensors(os.path.join(outdir, "gpt2_tiny_init.safetensors"))
    model = GPT2(cfg)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in init_sd.items()})
    g = torch.Generator().manual_seed(SEED_DATA)
    V, B, T = cfg["vocab_size"], GOLDEN_B, GOLDEN_T
    input_ids = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
    targets = torch.randint(0, V, (B, T), generator=g, dtype=torch.int64)
    targets[0, 3] = -100
    targets[1, 11] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(input_ids, targets)
    loss.backward()
    f32 = lambda t: t.detach().to(torch.float32)
    out = {"input_ids": input_ids, "targets": targets,
           "logits": f32(logits), "loss": f32(loss).reshape(1)}
    for n, p in model.named_parameters():
        out["grad." + n] = f32(p.grad)
    meta = {k: str(v) for k, v in cfg.items()}
    meta.update(batch=str(B), seq_len=str(T), ignore_index="-100",
                reference_dtype="bf16 autocast (torch.autocast cpu bfloat16), f32 master weights",
                torch_version=torch.__version__,
                generator="/usr/bin/python3 tools/dev/gpt2_torch.py --golden-bf16 tests/fixtures")
    save_safetensors(os.path.join(outdir, "gpt2_tiny_golden_bf16.safetensors"), out, meta)
    print(f"bf16 autocast: loss={float(loss):.6f}; wrote {outdir}/gpt2_tiny_golden_bf16.safetensors")


# --------------------------------------------------------------------------
# Benchmark
# --------------------------------------------------------------------------

def bench(preset, batch, ctx, threads, steps, warmup, dtype="f32"):
    cfg = PRESETS[preset]
    if ctx > cfg["block_size"]:
        sys.exit(f"--ctx {ctx} exceeds block_size {cfg['block_size']}")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = GPT2(cfg)                      # float32
    opt = make_optimizer(model)
    x = torch.randint(0, cfg["vocab_size"], (batch, ctx))
    y = torch.randint(0, cfg["vocab_size"], (batch, ctx))

    autocast = dtype == "bf16"

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        opt.step()
        return float(loss)

    for i in range(warmup):
        t0 = time.perf_counter()
        l = step()
        print(f"warmup {i}: loss={l:.4f} ms={(time.perf_counter()-t0)*1e3:.1f}",
              flush=True)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        l = step()
        dt = time.perf_counter() - t0
        times.append(dt)
        print(f"step {i}: loss={l:.4f} ms={dt*1e3:.1f} "
              f"tokens_per_s={batch*ctx/dt:.1f}", flush=True)
    # the median: the benchmark host is shared, and one slow step says little
    ms = 1e3 * sorted(times)[(len(times) - 1) // 2]
    # ru_maxrss is in KiB on Linux.
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"torch: preset={preset} dtype={'bf16-autocast' if autocast else 'f32'} batch={batch} "
          f"ctx={ctx} threads={threads} ms_per_step={ms:.1f} tokens_per_s={batch*ctx*1e3/ms:.1f} "
          f"peak_rss_mb={rss_mb:.0f}")


# --------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(
        description="Independent PyTorch GPT-2 reference for fsdp-lua: "
                    "golden fixtures and a CPU training benchmark.")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--golden", metavar="OUTDIR",
                      help="write gpt2_tiny_init.safetensors and "
                           "gpt2_tiny_golden.safetensors into OUTDIR")
    mode.add_argument("--golden-bf16", metavar="OUTDIR",
                      help="write gpt2_tiny_golden_bf16.safetensors (bf16 autocast) "
                           "into OUTDIR, next to gpt2_tiny_init.safetensors")
    mode.add_argument("--bench", action="store_true",
                      help="time training steps (fwd, bwd, clip, AdamW)")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bench compute: f32, or bf16 autocast")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small",
                    help="model for --bench (default: small = GPT-2 124M)")
    ap.add_argument("--batch", type=int, default=4, help="bench batch size")
    ap.add_argument("--ctx", type=int, default=64, help="bench sequence length")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads (default: all cores)")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed bench steps (default 5)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed warm-up steps before timing (default 1)")
    args = ap.parse_args()

    if args.golden:
        golden(args.golden)
    elif args.golden_bf16:
        golden_bf16(args.golden_bf16)
    else:
        bench(args.preset, args.batch, args.ctx, args.threads, args.steps,
              args.warmup, args.dtype)


if __name__ == "__main__":
    main()
