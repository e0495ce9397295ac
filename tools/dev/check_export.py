#!/usr/bin/python3
"""Checks an fsdp-lua GPT-2 export against PyTorch.

    /usr/bin/python3 tools/dev/check_export.py MODEL.safetensors LOGITS.safetensors

MODEL is what `fsdp.checkpoint.export(path, sharded, {hf = true})` wrote:
Hugging Face GPT-2 names and layouts, the model config in the metadata.
LOGITS holds `input_ids` (B, T) and the engine's `logits` (B, T, padded
vocab) for them. The script builds the GPT-2 of tools/dev/gpt2_torch.py from
MODEL with load_state_dict(strict=True), runs the ids through it and
compares the logits of the real vocabulary with the engine's: within 1e-4.

Exit status: 0 pass, 1 fail, 77 skipped (this python has no torch).
The safetensors files are read by the small reader below, not the
`safetensors` package.
"""

import os
import sys

try:
    import torch
except ImportError as e:  # ctest counts 77 as skipped
    print(f"check_export: skipped: {sys.executable} cannot import torch ({e})")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_torch import GPT2, load_safetensors as read_safetensors  # noqa: E402


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    model_path, logits_path = sys.argv[1], sys.argv[2]
    tensors, meta = read_safetensors(model_path)
    cfg = {k: int(meta[k]) for k in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size")}
    model = GPT2(cfg)
    sd = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in tensors.items()}
    model.load_state_dict(sd, strict=True)
    model.eval()

    ref, _ = read_safetensors(logits_path)
    ids, engine = ref["input_ids"].long(), ref["logits"].double()
    with torch.no_grad():
        logits, _ = model(ids)
    V = cfg["vocab_size"]
    got = logits.double()
    want = engine[..., :V]
    if tuple(got.shape) != tuple(want.shape):
        print(f"check_export: FAIL: torch logits {tuple(got.shape)}, engine {tuple(want.shape)}")
        return 1
    diff = (got - want).abs().max().item()
    scale = want.abs().max().item()
    ok = diff <= 1e-4
    print(f"check_export: GPT-2 {cfg} from {model_path}: {len(tensors)} tensors, "
          f"logits {tuple(got.shape)}, max |torch - engine| = {diff:.3g} (logits up to {scale:.3g}): "
          f"{'ok' if ok else 'FAIL'} (tolerance 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
