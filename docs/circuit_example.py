"""The circuit of the demo's classifier: the numbers of docs/circuits.md and
docs/img/circuit.png.

The model is the demo's: the one-layer BERT-style classifier that
``semiring-backprop demo`` trains on FirstTokenRepeatedOnce (does the first token occur
again?), seed 0, the same weights (the same data, seed and settings), trained here
(about 30 s on 2 cores). The first validation example of each class is explained (the
gold class's logit, float64), its circuit printed (the largest sites, edges and
attention edges) and, pruned to its 4 largest head/MLP sites, written as an HTML view
and EAP-IG graph JSON; headless Chromium (the Debian package ``chromium``), where
installed, takes the screenshot:

    python docs/circuit_example.py                  # prints; writes into circuit_example/
    python docs/circuit_example.py --out DIR --png docs/img/circuit.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import semiring_backprop as sbp
from semiring_backprop.data import make_task
from semiring_backprop.experiments import first_token as ft
from semiring_backprop.experiments.common import accuracy, train, trained

COLUMNS = ["Real", "MaxProduct(neuron)"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="circuit_example")
    ap.add_argument("--png", default=None, help="a screenshot of the first example's view")
    args = ap.parse_args(argv)
    out = Path(args.out)
    config = ft.Config.quick()
    how = ft.training(config)
    task = make_task("FirstTokenRepeatedOnce", config.n, length=config.length,
                     vocab_size=config.vocab_size, seed=config.seed)  # fmt: skip

    def fit(m):
        return train(m, task.train, task.val, epochs=how["epochs"], lr=how["lr"],
                     batch_size=how["batch_size"], seed=0, stop_at=1.0, progress=False)  # fmt: skip

    net, _ = trained(ft.model(config, 0), out / "model", fit)
    net = net.double().eval()
    print(f"seed 0: validation accuracy {accuracy(net, task.val):.1%}")
    for label in (1, 0):
        i = int((task.val.y == label).nonzero()[0])
        x = task.val.x[i : i + 1]
        tokens = [str(t) for t in x[0].tolist()]
        c = sbp.circuit(net, kwargs={"input_ids": x}, output=lambda o, y=label: o.logits[0, y],
                        tokens=tokens, what=f"gold logit (class {label}) of validation "
                        f"example {i}")  # fmt: skip
        print(f"\nvalidation example {i}: tokens {' '.join(tokens)}, label {label}")
        n = c.nodes
        print("target:", n[n.role == "target"][COLUMNS].to_string(index=False, header=False))
        sites = n[n.role.isin(["head", "mlp"])]
        sites = sites.sort_values("Real", key=abs, ascending=False).head(4)
        print("largest head/MLP sites (Real):")
        print(sites[["role", "head_index", "position", "token", *COLUMNS]].to_string(index=False))
        e = c.edges.sort_values("Real", key=abs, ascending=False).head(6)
        print("largest edges through the residual stream (Real):")
        cols = ["src_role", "src_head_index", "dst_role", "dst_head_index", "input", "position"]
        print(e[[*cols, "token", *COLUMNS]].to_string(index=False))
        a = c.attention_edges.sort_values("Real", key=abs, ascending=False).head(3)
        print("largest attention edges (value at src_position -> head output at dst_position):")
        cols = ["head_index", "src_position", "dst_position", "src_token", "dst_token"]
        print(a[[*cols, *COLUMNS]].to_string(index=False))
        kept = c.prune(top_n=4)
        kept.to_html(out / f"example{i}.html")
        (out / f"example{i}.eap.json").write_text(json.dumps(kept.to_eap_json()))
        if label == 1 and args.png:
            browser = shutil.which("chromium") or shutil.which("chromium-browser")
            if browser is None:
                print("no chromium: no screenshot")
                continue
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            f"--screenshot={Path(args.png).resolve()}", "--window-size=900,480",
                            (out / f"example{i}.html").resolve().as_uri()],
                           check=True, capture_output=True, timeout=120)  # fmt: skip
            print(f"wrote {args.png}")
    print(f"\nwrote {out}/")


if __name__ == "__main__":
    main()
