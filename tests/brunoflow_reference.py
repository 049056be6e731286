"""Make the brunoflow reference that paper mode is tested against (issue 30).

brunoflow (kdu4108/brunoflow) is the paper's own library; its BERT lives in a fork of
transformers (kdu4108/transformers, ``models/bert/modeling_bf_bert.py``). Neither is a
dependency of this project, and neither is copied into it: this script runs in a separate
environment that has them, and writes two small files that the tests read
(``tests/test_paper_mode.py``):

- ``tests/data/brunoflow_reference.safetensors``: the weights of two models with fixed
  random weights: a 1-layer BERT sequence classifier shaped as the paper's §5.1
  FirstTokenRepeatedOnce model (hidden 16, 2 heads, intermediate 32, vocabulary 20,
  ``experiments.first_token``) and a 2-layer BERT masked LM (vocabulary 30);
- ``tests/data/brunoflow_reference.json``: the configurations, the inputs, the logits, and
  for every module's input and output (named by its module path, as our traced graph
  tags them), brunoflow's max-product values (``max_grad_of_output_wrt_node``: hi, and
  ``max_neg_grad_of_output_wrt_node``: lo) and its entropy (``log Z`` with Z its
  ``abs_val_grad``, and ``H = entropy_wrt_output / Z + log Z``), for the gold logit of a
  few classifier inputs and one vocabulary logit at a position of a few masked-LM inputs.

How to rerun it (about a minute)::

    # fetch the two repositories (any commit of brunoflow's master and the fork's main)
    git clone https://github.com/kdu4108/brunoflow /tmp/bf
    git clone --depth 1 https://github.com/kdu4108/transformers /tmp/bftf
    # brunoflow pins jax 0.3.25, which no longer installs; 0.4.13 runs it unchanged
    python -m venv /tmp/bfenv
    /tmp/bfenv/bin/pip install torch "jax[cpu]==0.4.13" "numpy<2" "scipy<1.13" colorama \\
        networkx graphviz "tokenizers<0.14" "huggingface-hub<0.20" filelock regex \\
        requests tqdm pyyaml packaging safetensors
    PYTHONPATH=/tmp/bf:/tmp/bftf/src /tmp/bfenv/bin/python tests/brunoflow_reference.py

The script checks that brunoflow's logits equal the fork's own PyTorch BERT's on the
same weights before it writes anything.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
WEIGHTS = DATA / "brunoflow_reference.safetensors"
REFERENCE = DATA / "brunoflow_reference.json"

#: the two models: the §5.1 classifier (experiments.first_token's shape) and a masked LM
MODELS = {
    "classifier": dict(
        vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_labels=2, max_position_embeddings=10, type_vocab_size=1,
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ),
    "masked_lm": dict(
        vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=12, type_vocab_size=2,
        pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ),
}  # fmt: skip

#: (input ids, what is explained): the classifier's gold logit (class index), the masked
#: LM's logit of a vocabulary entry at a position
INPUTS = {
    "classifier": [
        ([7, 3, 11, 7, 5, 18, 2, 9, 14, 6], 1),  # the first token repeated once
        ([4, 12, 8, 15, 1, 19, 3, 10, 17, 13], 0),  # not repeated
        ([16, 16, 2, 5, 9, 1, 11, 3, 8, 12], 1),  # repeated right after
    ],
    "masked_lm": [
        ([2, 14, 7, 21, 5, 28, 9, 3], (3, 17)),
        ([11, 4, 25, 19, 8, 2, 13, 6], (5, 22)),
    ],
}


def weights(name: str, shapes: dict, seed: int) -> dict:
    """Fixed random weights, large enough for the signs to mix (layer norm gains around
    1 with some negative, everything else N(0, 0.5)); deterministic from the seed."""
    rng = np.random.default_rng(seed)
    out = {}
    for key in sorted(shapes):
        shape = shapes[key]
        w = rng.normal(0.0, 0.5, size=shape)
        if key.endswith("LayerNorm.weight"):
            w = 1.0 + w
        out[f"{name}.{key}"] = w.astype(np.float32)
    return out


def _number(x: float):
    x = float(x)
    if math.isnan(x):
        return None
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return float(f"{x:.6g}")  # (float32 agreement is tested to 1e-4)


def _list(a) -> list:
    a = np.asarray(a, dtype=np.float64)
    return np.vectorize(_number, otypes=[object])(a).tolist() if a.ndim else _number(a)


def main() -> None:
    import brunoflow as bf
    import torch
    from safetensors.numpy import save_file
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification
    from transformers.models.bert.modeling_bf_bert import (
        BfBertForMaskedLM,
        BfBertForSequenceClassification,
    )

    classes = {
        "classifier": (BfBertForSequenceClassification, BertForSequenceClassification),
        "masked_lm": (BfBertForMaskedLM, BertForMaskedLM),
    }
    all_weights, reference = {}, {"models": {}}
    for seed, (name, cfg) in enumerate(MODELS.items()):
        config = BertConfig(**cfg)
        bf_cls, torch_cls = classes[name]
        bf_model = bf_cls(config)
        bf_model.eval()
        params = dict(bf_model.named_parameters())
        # the masked LM's decoder shares the word embeddings (tied, as in Hugging Face)
        own = {k: tuple(p.val.shape) for k, p in params.items()
               if k != "cls.predictions.decoder.weight"}  # fmt: skip
        w = weights(name, own, seed)
        all_weights.update(w)
        state = {k.removeprefix(f"{name}."): v for k, v in w.items()}
        if "cls.predictions.decoder.weight" in params:
            state["cls.predictions.decoder.weight"] = state[
                "bert.embeddings.word_embeddings.weight"
            ]
        for k, p in params.items():
            p.val = bf.ad.node.jnp.asarray(state[k])
        torch_model = torch_cls(config).eval()
        missing, unexpected = torch_model.load_state_dict(
            {k: torch.from_numpy(v) for k, v in state.items()}, strict=False
        )
        tied = ("position_ids", "cls.predictions.decoder")  # a buffer; tied to what is loaded
        assert not unexpected and all(k.startswith(tied) or "position_ids" in k for k in missing)
        examples = []
        for ids, target in INPUTS[name]:
            examples.append(_explain(bf, bf_model, torch_model, ids, target))
        reference["models"][name] = {"config": cfg, "examples": examples}
        print(f"{name}: {len(examples)} examples, {len(examples[0]['nodes'])} nodes each")
    DATA.mkdir(exist_ok=True)
    save_file(all_weights, str(WEIGHTS))
    REFERENCE.write_text(json.dumps(reference, separators=(",", ":")) + "\n")
    print(f"wrote {WEIGHTS} ({WEIGHTS.stat().st_size} bytes)")
    print(f"wrote {REFERENCE} ({REFERENCE.stat().st_size} bytes)")


def _explain(bf, bf_model, torch_model, ids, target) -> dict:
    """One input: brunoflow's forward with every module's input and output recorded, the
    backward pass from the explained logit, and the values at the recorded nodes."""
    import torch
    from jax import numpy as jnp

    paths = {id(m): p for p, m in bf_model.named_modules() if p}
    recorded: dict = {}  # module path (":input" for an input) -> node
    network = bf.net.Network
    call = network.__call__

    def first_node(x):
        if isinstance(x, bf.ad.Node):
            return x
        items = x.values() if isinstance(x, dict) else x if isinstance(x, tuple | list) else ()
        for item in items:
            if isinstance(item, bf.ad.Node) and jnp.issubdtype(item.val.dtype, jnp.floating):
                return item
        return None

    def recording(self, *args, **kwargs):
        path = paths.get(id(self))
        if path is not None:
            x = first_node([*args, *kwargs.values()])
            if x is not None:
                recorded.setdefault(path + ":input", x)
        out = call(self, *args, **kwargs)
        if path is not None and first_node(out) is not None:
            recorded.setdefault(path, first_node(out))
        return out

    network.__call__ = recording
    try:
        out = bf_model(input_ids=jnp.asarray([ids], dtype=jnp.int32))
    finally:
        network.__call__ = call
    logits = out.logits if hasattr(out, "logits") else out[0]
    with torch.no_grad():
        expected = torch_model(input_ids=torch.tensor([ids])).logits.numpy()
    assert np.allclose(np.asarray(logits.val), expected, rtol=1e-4, atol=1e-5), (
        "brunoflow's logits differ from the PyTorch model's",
        np.abs(np.asarray(logits.val) - expected).max(),
    )
    if isinstance(target, int):
        scalar = logits[0, target]
    else:
        scalar = logits[0, target[0], target[1]]
    scalar.backprop(values_to_compute=("grad", "max_grad", "abs_val_grad", "entropy"))
    nodes, seen = {}, {}
    for path, node in recorded.items():
        if node.id in seen:  # the same tensor under another name (an input that is an
            nodes[path] = {"same_as": seen[node.id]}  # earlier module's output)
            continue
        seen[node.id] = path
        z = np.asarray(node.abs_val_grad, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            log_z = np.log(z)
            entropy = np.asarray(node.entropy_wrt_output, dtype=np.float64) / z + log_z
        nodes[path] = {
            "shape": list(node.shape),
            "hi": _list(node.max_grad_of_output_wrt_node[0]),
            "lo": _list(node.max_neg_grad_of_output_wrt_node[0]),
            "grad": _list(node.grad),
            "log_z": _list(log_z),
            "entropy": _list(entropy),
        }
    return {
        "input_ids": list(ids),
        "target": target if isinstance(target, int) else list(target),
        "logits": _list(logits.val),
        "nodes": nodes,
    }


if __name__ == "__main__":
    sys.exit(main())
