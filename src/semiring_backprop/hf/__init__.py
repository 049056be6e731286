"""The Hugging Face entry point.

- :mod:`.loading`: checkpoints, tokenizers, words and devices, by name or directory;
- :mod:`.tasks`: what a task (classification, token labels, similarity) explains;
- :mod:`.explain`: :func:`~semiring_backprop.hf.explain.explain`;
- :mod:`.explanation`: what it returns, the
  :class:`~semiring_backprop.hf.explanation.Explanation` (report, view, files, figures).
"""
