#!/usr/bin/env python3
"""Writes tests/golden/smollm2_engine.json: llama.cpp's logits and greedy continuations on the
default model (SmolLM2-135M-Instruct Q4_1), the reference for tests/unit/test_golden.c.

For each prompt (plain text and ChatML chats with SmolLM2's default system prompt; short ones
and three of about 500 tokens; prose, code, a list, arithmetic, a story opening, French,
Spanish, German and Chinese):
  1. tokenize with llama.cpp (add_bos=False: SmolLM2 adds no BOS; special=True so ChatML
     markers are control tokens);
  2. greedy continuation: evaluate the prompt, then one token at a time take the argmax of the
     last logits (temperature 0), up to MAX_NEW tokens or until EOS, which is kept as the last
     token (`stop` says which);
  3. evaluate prompt + continuation again in one pass (n_batch = n_ubatch = n_ctx) with logits
     for every position, and record per position the top-5 (token, logit) pairs, logit
     descending (ties: lower id first), rounded to 4 decimals. positions[i] is the prediction
     made after tokens[0..i], so positions[n_prompt - 1 + k] predicts continuation token k.
Step 2 decodes one token per pass while step 3 runs one batch: `greedy_vs_batch` lists the
continuation steps where the two disagree about the argmax (only possible at near-ties).
  4. as a yardstick for other implementations, evaluate prompt + continuation once more one
     token per pass and compare with step 3 the way tests/unit/test_golden.c compares Tandem:
     `llama_cpp_self` has the argmax agreement and the differences of the top-5 logits, raw and
     centered (minus their mean at each position; softmax ignores a common shift).

llama.cpp is used through llama-cpp-python on the CPU (flash attention off, f16 KV cache,
its defaults) with ggml's extra weight buffer types off (`use_extra_bufts = False`): those are
the AMX and repacked-weight kernels, which depend on the machine (AMX tile instructions trap
with SIGILL in VMs that do not enable AMX state, as on the machine that made the file), while
the plain kernels (q4_1 x q8_1 dot products, llamafile sgemm for batches) are what every x86
CPU runs. Pinned version: llama-cpp-python==0.3.36 (others print a warning).

Usage: python3 tests/golden/make_engine_golden.py [MODEL.gguf] [-o OUT.json]
MODEL defaults to $TANDEM_MODEL or ~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf.
"""

import argparse
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

PINNED = {"llama_cpp_python": "0.3.36", "numpy": "2.4.6"}
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MAX_NEW = 64
TOP_K = 5
N_CTX = 2048

HERE = Path(__file__).resolve().parent

# SmolLM2's chat template adds this system turn when a chat has none (see
# smollm2_tokenizer.json "default_system").
SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n")


def chat(user):
    return SYSTEM + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


LONG_ESSAY = """\
The history of computing is often told as a story of machines, but it is just as much a story \
of ideas about how to describe work precisely. Long before electronic computers existed, \
weavers in Lyon used chains of punched cards to control the patterns of their looms. Each card \
described one row of the fabric, and a pattern was nothing more than a long sequence of cards. \
In the nineteenth century Charles Babbage borrowed this idea for his Analytical Engine, a \
mechanical calculator that was never finished but that contained, on paper, most of the parts \
of a modern computer: a store for numbers, a mill for arithmetic, and a way to repeat and \
branch. Ada Lovelace, who wrote the most detailed notes on the engine, saw that such a machine \
could manipulate symbols of any kind, not only numbers, and that music or language might one \
day be processed in the same way.

The first electronic computers of the 1940s were built for war work: breaking codes, computing \
artillery tables, and simulating explosions. They filled rooms, used thousands of vacuum tubes, \
and failed often. Programming them meant setting switches and plugging cables, a slow process \
that could take days for a single problem. The stored-program design, in which instructions \
live in the same memory as data, changed this. A program became something that could be \
loaded, copied, and modified like any other information, and that idea is still the basis of \
every computer in use today.

During the 1950s and 1960s, transistors replaced vacuum tubes and integrated circuits replaced \
individual transistors. Machines became smaller, cheaper and far more reliable. At the same \
time, programmers invented languages such as FORTRAN, COBOL and LISP, which let people write \
instructions in a form closer to mathematics or English, and compilers translated them into \
machine code. Operating systems appeared to share one expensive computer among many users, \
and the first networks connected computers at universities and research laboratories.

The personal computer arrived in the late 1970s. For the first time an individual could own a \
computer, write programs for it at home, and use it for games, letters and accounts. Within \
two decades, the growth of the internet turned these isolated machines into a global network. \
Today, the phone in a pocket is more powerful than the supercomputers of the 1980s, and the \
main challenge is no longer the cost of computation but deciding what is worth computing."""

LONG_CODE = '''\
"""A small inventory system: items, stock levels and orders."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Item:
    sku: str
    name: str
    price_cents: int
    weight_grams: int = 0
    tags: List[str] = field(default_factory=list)

    def price(self) -> float:
        """The price in dollars."""
        return self.price_cents / 100.0


@dataclass
class OrderLine:
    sku: str
    quantity: int


class OutOfStock(Exception):
    """Raised when an order asks for more units than are in stock."""

    def __init__(self, sku: str, wanted: int, available: int):
        super().__init__(f"{sku}: wanted {wanted}, only {available} in stock")
        self.sku = sku
        self.wanted = wanted
        self.available = available


class Inventory:
    def __init__(self) -> None:
        self.items: Dict[str, Item] = {}
        self.stock: Dict[str, int] = {}

    def add_item(self, item: Item, quantity: int = 0) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item
        self.stock[item.sku] = quantity

    def restock(self, sku: str, quantity: int) -> None:
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.stock[sku] = self.stock.get(sku, 0) + quantity

    def find(self, sku: str) -> Optional[Item]:
        return self.items.get(sku)

    def total_value_cents(self) -> int:
        return sum(self.items[s].price_cents * n for s, n in self.stock.items())

    def place_order(self, lines: List[OrderLine]) -> int:
        """Removes the ordered units from stock and returns the order total in cents.
        Nothing is removed when any line cannot be filled."""
        for line in lines:
            available = self.stock.get(line.sku, 0)
            if line.quantity > available:
                raise OutOfStock(line.sku, line.quantity, available)
        total = 0
        for line in lines:
            self.stock[line.sku] -= line.quantity
            total += self.items[line.sku].price_cents * line.quantity
        return total

    def low_stock(self, threshold: int = 5) -> List[str]:
        """SKUs whose stock is below the threshold, sorted by name."""
'''

LONG_CHAT_DOC = """\
Read the following report and answer the question after it.

Report: The town council of Millbrook met on Tuesday evening to discuss three proposals. The \
first proposal concerned the old railway station, which has been empty since the line closed \
in 1998. A local group wants to turn the building into a library and community center, with \
a reading room, a small café and space for evening classes. They estimate the renovation will \
cost 2.4 million dollars, of which 1.5 million could come from a regional heritage fund. \
Several residents spoke in favor, pointing out that the current library is too small and has \
no parking. Others worried about the cost of heating such a large building in winter.

The second proposal was to reduce the speed limit on Main Street from 50 to 30 kilometers per \
hour between the school and the market square. Police figures show eleven accidents on that \
stretch in the last three years, four of them involving cyclists. Shop owners were divided: \
some believe slower traffic will bring more customers on foot, while others fear that drivers \
will avoid the center altogether.

The third proposal, which took most of the evening, was a plan to build 120 new homes on \
farmland north of the river. The developer promised that forty of the homes would be sold at \
reduced prices to first-time buyers. Opponents argued that the land floods every few years \
and that the town's water treatment plant is already near its capacity. An engineer hired by \
the council said that the flood risk could be managed with raised foundations and a new \
drainage channel, but that the water plant would need an upgrade costing around 800,000 \
dollars within five years.

After a long debate, the council approved the station renovation, subject to the heritage \
fund grant being confirmed, and approved the lower speed limit for a trial period of one \
year. The housing plan was postponed until the next meeting, when the council expects a full \
report on the water plant and on how the upgrade would be paid for.

Question: Which proposals did the council approve, and why was the housing plan postponed? \
Answer in a short paragraph."""

CASES = [
    ("plain_capital", "The capital of France is"),
    ("plain_story", "Once upon a time, in a small village at the edge of a great forest, there "
                    "lived"),
    ("plain_code_fib", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("plain_list_planets", "Here is a list of the planets in our solar system, in order from "
                           "the Sun:\n\n1."),
    ("plain_math", "Question: A shop sells pencils at 3 for 45 cents. How much do 12 pencils "
                   "cost?\nAnswer:"),
    ("plain_french", "La Révolution française a commencé en 1789, lorsque"),
    ("chat_capital", chat("What is the capital of Japan?")),
    ("chat_math", chat("If a train travels 180 km in 2 hours and 15 minutes, what is its "
                       "average speed in km/h? Show your steps.")),
    ("chat_code_c", chat("Write a C function that reverses a string in place.")),
    ("chat_list", chat("List five fruits that are rich in vitamin C, one per line.")),
    ("chat_spanish", chat("¿Cuál es la montaña más alta del mundo y dónde está?")),
    ("chat_chinese_german", chat("请用一句话介绍太阳系。Then say the same in German.")),
    ("chat_story", chat("Write the opening of a short story about a lighthouse keeper who "
                        "finds a message in a bottle.")),
    ("long_essay", LONG_ESSAY + "\n\nIn the coming decades,"),
    ("long_code", LONG_CODE),
    ("long_chat_report", chat(LONG_CHAT_DOC)),
]


def check_versions():
    for name, want in PINNED.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != want:
            print(f"warning: {name} {have} installed, the golden file was made with {want}",
                  file=sys.stderr)


def top_k(row, k):
    """[[token, logit], ...] of the k largest logits, descending, ties by lower id."""
    import numpy as np

    idx = np.argpartition(-row, k)[:k]
    order = sorted(idx.tolist(), key=lambda t: (-float(row[t]), t))
    return [[t, round(float(row[t]), 4)] for t in order]


def greedy(llm, prompt, eos):
    """llama.cpp's greedy continuation: the prompt in one pass, then one token per pass. eos: a
    token id or a set of them (the first one generated ends the run and is kept)."""
    import numpy as np

    stops = eos if isinstance(eos, (set, frozenset)) else {eos}
    llm.reset()
    llm.eval(prompt)
    out = []
    while len(out) < MAX_NEW:
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        if nxt in stops:
            return out, "eos"
        llm.eval([nxt])
    return out, "length"


def evaluate_one_by_one(llm, tokens):
    """Logits of every position of tokens, one token per pass. Returns an [n][n_vocab] copy."""
    llm.reset()
    for t in tokens:
        llm.eval([t])
    return llm.scores[: len(tokens)].copy()


class SelfCheck:
    """llama.cpp one token per pass against its one-pass top-5, as test_golden.c measures."""

    def __init__(self):
        self.n = self.agree = self.n_gap = self.agree_gap = 0
        self.raw = []
        self.centered = []
        self.max_gap_disagree = 0.0

    def add(self, positions, logits):
        import numpy as np

        for i, top in enumerate(positions):
            toks = [t for t, _ in top]
            ref = np.array([v for _, v in top])
            ours = logits[i, toks].astype(np.float64)
            d = ours - ref
            self.raw.extend(np.abs(d).tolist())
            self.centered.extend(np.abs(d - d.mean()).tolist())
            ok = int(np.argmax(logits[i])) == toks[0]
            gap = float(ref[0] - ref[1])
            self.n += 1
            self.agree += ok
            if gap >= 0.25:
                self.n_gap += 1
                self.agree_gap += ok
            if not ok:
                self.max_gap_disagree = max(self.max_gap_disagree, gap)

    def summary(self):
        import numpy as np

        raw, cen = np.array(self.raw), np.array(self.centered)
        r = lambda x: round(float(x), 4)  # noqa: E731
        return {
            "what": "llama.cpp one token per pass vs the one-pass top-5 of this file",
            "positions": self.n,
            "argmax_agreement": r(self.agree / self.n),
            "argmax_agreement_gap_ge_0.25": r(self.agree_gap / self.n_gap),
            "max_gap_at_disagreement": r(self.max_gap_disagree),
            "max_abs_diff": r(raw.max()), "mean_abs_diff": r(raw.mean()),
            "max_centered_diff": r(cen.max()), "mean_centered_diff": r(cen.mean()),
        }


def evaluate(llm, tokens):
    """Logits of every position of tokens, in one pass. Returns an [n][n_vocab] copy."""
    llm.reset()
    llm.eval(tokens)
    return llm.scores[: len(tokens)].copy()


def dump(doc, path):
    """JSON with one line per case field and one line per position, ASCII only."""
    lines = ["{"]
    for k, v in doc.items():
        if k != "cases":
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    lines.append('  "cases": [')
    for ci, case in enumerate(doc["cases"]):
        lines.append("    {")
        for k, v in case.items():
            if k != "positions":
                lines.append(f"      {json.dumps(k)}: {json.dumps(v)},")
        lines.append('      "positions": [')
        rows = [f"        {json.dumps(p, separators=(',', ':'))}" for p in case["positions"]]
        lines.append(",\n".join(rows))
        lines.append("      ]")
        lines.append("    }" + ("," if ci + 1 < len(doc["cases"]) else ""))
    lines.append("  ]")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


def open_llama(model_path, n_ctx=N_CTX):
    """llama.cpp on the CPU as the golden files use it (no extra buffer types, two threads,
    logits for every position; n_batch = n_ubatch = n_ctx so that the one-pass evaluation
    really is one llama_decode call)."""
    import llama_cpp

    # The constructor does not expose use_extra_bufts: wrap the defaults it starts from.
    import llama_cpp.llama_cpp as llama_c

    default_params = llama_c.llama_model_default_params

    def model_params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_c.llama_model_default_params = model_params
    return llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_ctx,
                           n_ubatch=n_ctx, logits_all=True, n_threads=2, n_threads_batch=2,
                           seed=0, verbose=False)


def run_case(llm, name, text, prompt, eos, selfcheck, n_ctx=N_CTX):
    """One golden case: llama.cpp's greedy continuation of prompt (token ids), then the top-k
    of every position of prompt + continuation evaluated in one pass."""
    import numpy as np

    cont, stop = greedy(llm, prompt, eos)
    tokens = prompt + cont
    assert len(tokens) <= n_ctx
    logits = evaluate(llm, tokens)
    positions = [top_k(logits[i], TOP_K) for i in range(len(tokens))]
    n_prompt = len(prompt)
    mismatch = [k for k in range(len(cont))
                if int(np.argmax(logits[n_prompt - 1 + k])) != cont[k]]
    selfcheck.add(positions, evaluate_one_by_one(llm, tokens))
    gaps = [positions[n_prompt - 1 + k][0][1] - positions[n_prompt - 1 + k][1][1]
            for k in range(len(cont))]
    print(f"{name}: {n_prompt} prompt + {len(cont)} generated ({stop}), smallest gap "
          f"{min(gaps):.4f}, greedy/batch argmax differ at {mismatch}", file=sys.stderr)
    return {
        "name": name,
        "prompt": text,
        "n_prompt": n_prompt,
        "n_continuation": len(cont),
        "stop": stop,
        "continuation_text": llm.detokenize(cont, special=True).decode("utf-8", "replace"),
        "greedy_vs_batch": mismatch,
        "tokens": tokens,
        "positions": positions,
    }


def model_sha256(model, want):
    """The file's SHA-256; warns when it is not the one the golden file is meant for."""
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    if sha != want:
        print(f"warning: {model} has sha256 {sha}, not the expected {want}", file=sys.stderr)
    return sha


def write_doc(out, model, sha, llm, generator, reference, eos, selfcheck, cases, extra=None):
    """The golden JSON (see tests/golden/README.md), checked to parse back."""
    import llama_cpp

    doc = {
        "model": model.name,
        "model_sha256": sha,
        "model_bytes": model.stat().st_size,
        "generator": generator,
        "versions": {"llama_cpp_python": llama_cpp.__version__,
                     "numpy": metadata.version("numpy")},
        "reference": reference,
        "eos": eos,
        "max_new": MAX_NEW,
        "top_k": TOP_K,
        "n_vocab": llm.n_vocab(),
        **(extra or {}),
        "llama_cpp_self": selfcheck.summary(),
        "cases": cases,
    }
    out = Path(out)
    dump(doc, out)
    json.loads(out.read_text(encoding="ascii"))  # well-formed
    print(f"llama.cpp against itself: {doc['llama_cpp_self']}", file=sys.stderr)
    print(f"wrote {out}: {len(cases)} cases, {sum(len(c['tokens']) for c in cases)} positions, "
          f"{out.stat().st_size} bytes", file=sys.stderr)


def main():
    default_model = os.environ.get("TANDEM_MODEL") or str(
        Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=default_model)
    ap.add_argument("-o", "--output", default=str(HERE / "smollm2_engine.json"))
    args = ap.parse_args()

    check_versions()
    model = Path(args.model)
    if not model.exists():
        sys.exit(f"{model}: not found (run scripts/setup to download the default model)")
    sha = model_sha256(model, MODEL_SHA256)
    llm = open_llama(model)
    eos = llm.token_eos()

    cases = []
    selfcheck = SelfCheck()
    for name, text in CASES:
        prompt = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append(run_case(llm, name, text, prompt, eos, selfcheck))
    reference = ("llama.cpp (llama-cpp-python) CPU, f16 KV, no flash attention, no extra "
                 "buffer types (AMX/repack), "
                 f"n_ctx {N_CTX}, n_threads 2; tokens add_bos=False special=True; "
                 f"greedy (argmax) continuation of up to {MAX_NEW} tokens, EOS kept; "
                 "logits of prompt+continuation in one pass")
    write_doc(args.output, model, sha, llm, "tests/golden/make_engine_golden.py", reference, eos,
              selfcheck, cases)


if __name__ == "__main__":
    main()
