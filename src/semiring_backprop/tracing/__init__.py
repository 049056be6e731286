"""Model + example inputs + output function -> :class:`~semiring_backprop.graph.Graph`.

- :mod:`.trace`: ``torch.export`` (non-strict), module marks, the ATen-level graph;
- :mod:`.blocks`, :mod:`.record`, :mod:`.stitch`: a repeated block (a transformer's
  layer) traced once, the others' traces copies of its, checked by a record of the
  torch functions each one's code calls;
- :mod:`.decompositions`: composite ops into primitives (and paper mode's formulas);
- :mod:`.decompose`: the table applied to an exported graph, each distinct op traced
  once (``run_decompositions``'s graph, faster);
- :mod:`.ops`: the custom ops the tracer puts in graphs (``mark``, ``softmax_shift``);
- :mod:`.checks`: what a trace cannot see, refused or checked against eager;
- :mod:`.reuse`: when a kept trace may serve a new call (keys of inputs, output
  functions and models).
"""
