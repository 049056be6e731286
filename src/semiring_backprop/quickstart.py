"""The built-in quickstart: several semirings on a small model, explained in words."""

from __future__ import annotations

import math

import torch

from ._backprop import backprop
from ._threads import threads
from .semirings import Entropy, MaxProduct, PathCount, Real, TopK


class TinyClassifier(torch.nn.Module):
    """A one-layer transformer classifier over token embeddings (random, seeded)."""

    def __init__(self, vocab=20, d=16, heads=2, classes=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.encoder = torch.nn.TransformerEncoderLayer(
            d, heads, dim_feedforward=32, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(d, classes)

    def forward(self, ids):
        h = self.encoder(self.embed(ids))
        return self.head(h[:, 0])


@threads()
def run(seed: int = 0, print_fn=print) -> dict:
    torch.manual_seed(seed)
    model = TinyClassifier().double().eval()
    ids = torch.tensor([[3, 7, 1, 3, 9, 4]])
    semirings = [Real(), MaxProduct(), Entropy(), PathCount(), TopK(3)]
    res = backprop(model, (ids,), output=lambda logits: logits[0, 1], semirings=semirings)
    grad = res.at("embed", Real())[0]
    top = res.aggregate("embed", MaxProduct(), dims=(-1,))
    ent = res.at("embed", Entropy())
    count = res.at("embed", PathCount())
    topk = res.at("embed", TopK(3)).values[0]
    p = print_fn
    p("semiring-backprop quickstart: a 1-layer transformer classifier (random weights),")
    p(f"explaining logit[1] for the token ids {ids[0].tolist()}. One reverse pass computed")
    p("five semirings at every node; here they are at the token embeddings.\n")
    p(
        "token  |grad|   top path +   top path -   entropy  H/log(#paths)"
        "  3 heaviest paths (one unit)"
    )
    rows = []
    for t in range(ids.shape[1]):
        h = ent.entropy[0, t]
        lc = count.log_count[0, t]
        j = int(topk[t].abs()[:, 0].argmax())
        norm_h = (h / lc).mean().item() if bool((lc > 0).all()) else math.nan
        row = {
            "token": t,
            "grad_norm": grad[t].norm().item(),
            "max_path": top.hi[0, t].item(),
            "min_path": top.lo[0, t].item(),
            "entropy": h.mean().item(),
            "entropy_normalized": norm_h,
            "top3": [round(v, 5) for v in topk[t, j].tolist()],
        }
        rows.append(row)
        p(
            f"{t:>5}  {row['grad_norm']:.4f}  {row['max_path']:+.3e}  {row['min_path']:+.3e}"
            f"  {row['entropy']:7.3f}  {norm_h:13.3f}  {row['top3']}"
        )
    p("\nHow to read it:")
    p("  |grad|        Real semiring: the ordinary gradient (equals torch.autograd).")
    p("  top path ±    MaxProduct: the single most positive / most negative product of")
    p("                local derivatives along one path from the token to the logit.")
    p("  entropy       Entropy: how spread out gradient flow is over all paths (mean over")
    p("                hidden units); H/log(#paths) is 1 when every path carries equal flow.")
    p("  heaviest      TopK(3): the three largest-|product| paths from one hidden unit.")
    return {"rows": rows}
