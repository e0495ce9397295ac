"""safetensors_ref.py: an independent reading of the safetensors format, the
reference of tests/fuzz/test_fuzz_safetensors.lua.

    python3 safetensors_ref.py LIST OUT

LIST holds one path per line; OUT gets a JSON list, one entry per path:
{"ok": false, "why": ...} for a file the format does not allow, else
{"ok": true, "tensors": {name: [dtype, shape, first byte, end byte]}} with
byte positions in the file. Lenient where the format leaves room (JSON
syntax, extra keys), strict where it does not: the header length, known
dtypes, sizes that match shapes, offsets that tile the data section with
no hole, no overlap and nothing after it.
"""
import json
import sys

SIZES = {"F32": 4, "BF16": 2, "I32": 4, "I64": 8, "U16": 2}


def is_count(v):
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return 0 <= v < 2**53
    if isinstance(v, float):
        return v.is_integer() and 0 <= v < 2**53
    return False


def no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError("duplicate key " + k)
        d[k] = v
    return d


def read(path):
    with open(path, "rb") as f:
        b = f.read()
    if len(b) < 8:
        return {"ok": False, "why": "short"}
    n = int.from_bytes(b[:8], "little")
    if n > len(b) - 8:
        return {"ok": False, "why": "header length"}
    try:
        hdr = json.loads(b[8:8 + n].decode("utf-8"), strict=False, object_pairs_hook=no_duplicates)
    except Exception as e:  # not JSON, not UTF-8
        return {"ok": False, "why": "json: %s" % e}
    if not isinstance(hdr, dict):
        return {"ok": False, "why": "not an object"}
    data_len = len(b) - 8 - n
    meta = hdr.get("__metadata__")
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            return {"ok": False, "why": "metadata"}
    out, ranges = {}, []
    for name, e in hdr.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or e.get("dtype") not in SIZES:
            return {"ok": False, "why": "entry or dtype"}
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 8 or not all(is_count(s) for s in shape):
            return {"ok": False, "why": "shape"}
        if not isinstance(offs, list) or len(offs) != 2 or not all(is_count(o) for o in offs):
            return {"ok": False, "why": "offsets"}
        numel = 1
        for s in shape:
            numel *= int(s)
        lo, hi = int(offs[0]), int(offs[1])
        if hi < lo or hi - lo != numel * SIZES[e["dtype"]] or hi > data_len:
            return {"ok": False, "why": "offsets vs shape"}
        out[name] = [e["dtype"], [int(s) for s in shape], 8 + n + lo, 8 + n + hi]
        if hi > lo:
            ranges.append((lo, hi))
    ranges.sort()
    at = 0
    for lo, hi in ranges:
        if lo != at:
            return {"ok": False, "why": "hole or overlap"}
        at = hi
    if at != data_len:
        return {"ok": False, "why": "bytes after the data"}
    return {"ok": True, "tensors": out}


def main():
    paths = [p for p in open(sys.argv[1]).read().split("\n") if p]
    with open(sys.argv[2], "w") as f:
        json.dump([read(p) for p in paths], f)


if __name__ == "__main__":
    main()
