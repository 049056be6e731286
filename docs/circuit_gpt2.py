"""The circuit of a tiny GPT-2 trained on induction: the numbers of docs/circuits.md's
GPT-2 section and docs/img/circuit_gpt2.png.

A ``GPT2LMHeadModel`` from a small config (2 layers, 4 heads, d_model 48, 40 tokens,
24 positions) is trained (seed 0, AdamW, 4000 steps of 64 sequences: about two minutes
on 2 idle CPU cores, float32, saved and reloaded on a rerun) on sequences with a run
of 5 to 10 random tokens repeated once at a random place among filler tokens, the loss
on the next-token predictions inside the repeat only: what an induction mechanism can
predict (find the earlier occurrence of the current token, copy the token after it).
The run's length and place vary, so no fixed offset does it.

Then, on a held-out sequence, float64, the prediction at one position of the repeat is
explained: the logit of the right next token minus the logit of a token that the
sequence does not hold, which replaces one token in the corrupted input. The seed is
``x - x'`` at the token embeddings (``baseline=`` the embeddings of the corrupted ids):
only the replaced position differs, so every path of the circuit starts there. Two
corruptions: the needed token's first occurrence, and the token before it. Printed per
corruption: the largest sites, edges and attention edges; the circuit pruned to its 6
largest head/MLP sites is written as an HTML view and EAP-IG graph JSON, and headless
Chromium (the Debian package ``chromium``), where installed, takes the screenshots
(``--png`` and the same name with ``_previous``):

    python docs/circuit_gpt2.py                  # prints; writes into circuit_gpt2/
    python docs/circuit_gpt2.py --out DIR --png docs/img/circuit_gpt2.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import torch

import semiring_backprop as sbp
from semiring_backprop.experiments.common import trained

VOCAB, LENGTH, SEED = 40, 24, 0
STEPS, BATCH, LR = 4000, 64, 1e-2
COLUMNS = ["Real", "MaxProduct(neuron)"]


def model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=48, n_layer=2,
                        n_head=4, n_inner=192, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def sequences(n: int, generator: torch.Generator):
    """``n`` rows of ``LENGTH`` tokens (1..VOCAB-1): a run ``A`` of 5 to 10 distinct
    tokens at a random start, then ``A`` again, the other positions filler tokens not
    in ``A`` (so each token of the repeat has one earlier occurrence). The run's length
    and start vary, so no fixed offset finds the earlier occurrence: finding it takes
    the tokens. Returns ``(ids, predict, runs)``: ``predict[r, p]`` is True where the
    token at ``p + 1`` is predictable (inside the repeat, after its first token);
    ``runs[r]`` is ``(start, length)``."""
    ids = torch.empty(n, LENGTH, dtype=torch.long)
    predict = torch.zeros(n, LENGTH, dtype=torch.bool)
    runs = []
    for r in range(n):
        m = int(torch.randint(5, 11, (), generator=generator))
        k = int(torch.randint(0, LENGTH - 2 * m + 1, (), generator=generator))
        order = torch.randperm(VOCAB - 1, generator=generator) + 1
        run, filler = order[:m], order[m:]
        ids[r] = filler[torch.randint(0, len(filler), (LENGTH,), generator=generator)]
        ids[r, k : k + m] = run
        ids[r, k + m : k + 2 * m] = run
        predict[r, k + m : k + 2 * m - 1] = True
        runs.append((k, m))
    return ids, predict, runs


def fit(net) -> list[dict]:
    """AdamW (a cosine schedule) on the next-token loss at the predictable positions
    (the repeat's)."""
    g = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    # the loss sits on a plateau (guessing among the run's tokens) for about 2000 steps
    # before induction forms; a cosine decay then settles it
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, STEPS)
    history, start = [], time.time()
    net.train()
    for step in range(STEPS):
        x, predict, _ = sequences(BATCH, g)
        logits = net(input_ids=x).logits[:, :-1][predict[:, :-1]]
        loss = torch.nn.functional.cross_entropy(logits, x[:, 1:][predict[:, :-1]])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if step % 100 == 99 or step == STEPS - 1:
            history.append({"step": step + 1, "loss": loss.item(),
                            "seconds": round(time.time() - start, 1)})  # fmt: skip
            print(f"step {step + 1}: loss {loss.item():.4f} ({time.time() - start:.0f} s)")
    net.eval()
    return history


@torch.no_grad()
def accuracy(net, x, predict) -> float:
    """The share of the predictable tokens predicted (argmax) right."""
    pred = net(input_ids=x).logits[:, :-1].argmax(-1)
    return float((pred == x[:, 1:])[predict[:, :-1]].double().mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="circuit_gpt2")
    ap.add_argument("--png", default=None, help="a screenshot of the pruned circuit's view")
    ap.add_argument("--top-n", type=int, default=6, help="head/MLP sites kept in the view")
    args = ap.parse_args(argv)
    out = Path(args.out)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # training's sums are split the same way on every run
    try:
        net, _ = trained(model(), out / "model", fit)
    finally:
        torch.set_num_threads(before)
    held_out, predict, runs = sequences(256, torch.Generator().manual_seed(SEED + 1))
    print(f"held-out accuracy on the repeats: {accuracy(net, held_out, predict):.1%}")
    net = net.double().eval()

    ids = held_out[:1]
    start, m = runs[0]
    i = start + m + 3  # explained: the prediction at position i, inside the repeat;
    needed = int(ids[0, i + 1])  # the token it needs first occurs at i + 1 - m
    other = next(t for t in range(1, VOCAB) if t not in ids[0].tolist())
    tokens = [f"t{t}" for t in ids[0].tolist()]
    print(f"\ntokens: {' '.join(tokens)}")
    print(f"a run of {m} tokens at {start}, repeated at {start + m}; explained: at position "
          f"{i} ({tokens[i]}), logit(t{needed}) - logit(t{other})")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    # the needed token's first occurrence replaced (what the brief's induction reads),
    # then the token before it (what a previous-token head would carry)
    for name, replaced in (("", i + 1 - m), ("_previous", i - m)):
        corrupt = ids.clone()
        corrupt[0, replaced] = other
        with torch.no_grad():
            base = net.transformer.wte(corrupt)
            clean = net(input_ids=ids).logits[0, i]
            bad = net(input_ids=corrupt).logits[0, i]
        print(f"\n== corrupted: t{other} at position {replaced} (was {tokens[replaced]})")
        print(f"margin: clean {float(clean[needed] - clean[other]):.4f}, corrupted "
              f"{float(bad[needed] - bad[other]):.4f}")  # fmt: skip
        c = sbp.circuit(
            net, kwargs={"input_ids": ids},
            output=lambda o: o.logits[0, i, needed] - o.logits[0, i, other],
            baseline={"transformer.wte": base}, tokens=tokens,
            what=f"logit(t{needed}) - logit(t{other}) at position {i}, against "
            f"{tokens[replaced]} at {replaced} replaced by t{other}",
        )  # fmt: skip
        report(c)
        kept = c.prune(top_n=args.top_n)
        page = out / f"circuit{name}.html"
        kept.to_html(page)
        (out / f"circuit{name}.eap.json").write_text(json.dumps(kept.to_eap_json()))
        print(f"pruned to its {args.top_n} largest head/MLP sites: {kept!r}")
        print(str(kept.view()))
        if args.png:
            png = Path(args.png)
            screenshot(page, png.with_name(png.stem + name + png.suffix), "--window-size=1950,520")
    print(f"\nwrote {out}/")


def report(c):
    n = c.nodes
    print("target:", n[n.role == "target"][COLUMNS].to_string(index=False, header=False))
    sites = n[n.role.isin(["head", "mlp"])]
    sites = sites.sort_values("Real", key=abs, ascending=False).head(8)
    print("largest head/MLP sites (Real):")
    cols = ["layer", "role", "head_index", "position", "token", *COLUMNS]
    print(sites[cols].to_string(index=False))
    e = c.edges.sort_values("Real", key=abs, ascending=False).head(8)
    print("largest edges through the residual stream (Real):")
    cols = ["src_layer", "src_role", "src_head_index", "dst_layer", "dst_role",
            "dst_head_index", "input", "position"]  # fmt: skip
    print(e[[*cols, *COLUMNS]].to_string(index=False))
    a = c.attention_edges.sort_values("Real", key=abs, ascending=False).head(6)
    print("largest attention edges (value at src_position -> head output at dst_position):")
    cols = ["layer", "head_index", "src_position", "dst_position", "src_token", "dst_token"]
    print(a[[*cols, *COLUMNS]].to_string(index=False))


def screenshot(page: Path, png: str, size: str):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("no chromium: no screenshot")
        return
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                    f"--screenshot={Path(png).resolve()}", size, page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)  # fmt: skip
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
