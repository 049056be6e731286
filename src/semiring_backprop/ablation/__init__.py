"""Ablation: the effect of a site, an edge or a branch on the explained output when its
value is replaced by an ablated one, the scores checked against those effects, and the
faithfulness of a circuit (DESIGN §3b, last bullet).

- :mod:`.patching`: :class:`Patching`, the traced graph run again with some values
  ablated (a corrupted input, a mean over reference inputs, or zeros);
- :mod:`.patching_edges`: what edge patching reads (each destination, the ops that read
  its input, the residual-only region it is recomputed through);
- :mod:`.eap`: EAP and EAP-IG, edge scores from one backward pass;
- :mod:`.qk`: AtP*'s QK fix, edge and site scores with each head's attention pattern
  recomputed exactly where the score enters its query or key;
- :mod:`.faithfulness`: normalized faithfulness, its curve over circuit sizes, CPR, CMD,
  and the agreement of scores with exact effects.
"""

from .patching import EDGE_KEY, NODE_KEY, Patching

__all__ = ["EDGE_KEY", "NODE_KEY", "Patching"]
