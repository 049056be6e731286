"""Small GGUF files written here, as llama.cpp's converter writes them: a random Llama
with a byte-level BPE tokenizer trained on a few sentences, its weights as float32
tensors under GGUF's names (query and key rows permuted as llama.cpp stores them).

``write_llama(path)`` returns the model and the tokenizer it wrote, so a test can compare
what transformers loads back from the file with the model itself.
"""

from __future__ import annotations

import numpy as np
import torch

SENTENCES = [
    "When Mary and John went to the store, John gave a drink to Mary.",
    "The keys to the cabinet are on the table.",
    "The capital of France is Paris.",
    "A cat sat on the mat and the dog ran to the park.",
]


def bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (GPT-2's scheme: a space is ``Ġ``) trained on
    :data:`SENTENCES`, as a transformers fast tokenizer."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def llama(vocab_size: int, seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from one, so a lost norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order for a query or key projection (rotary halves interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama(path, *, arch: str = "llama", tokenizer: bool = True, seed: int = 0):
    """Write a random Llama and its tokenizer to the GGUF file ``path``; ``(model, tok)``.
    ``arch``: the architecture named in the metadata (another name writes a file
    transformers cannot build); ``tokenizer=False``: no tokenizer metadata."""
    import gguf

    tok = bpe_tokenizer()
    vocab = tok.get_vocab()
    model = llama(len(vocab), seed)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(len(vocab))
    if tokenizer:
        inner = tok.backend_tokenizer
        import json

        held = json.loads(inner.to_str())
        merges = [m if isinstance(m, str) else " ".join(m) for m in held["model"]["merges"]]
        tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
        special = {"<unk>", "<s>", "</s>"}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(vocab["<s>"])
        w.add_eos_token_id(vocab["</s>"])
        w.add_unk_token_id(vocab["<unk>"])
        w.add_add_bos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, p in model.state_dict().items():
        data = p.detach().float().numpy().copy()
        if name.endswith("q_proj.weight"):
            data = _permute(data, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            data = _permute(data, cfg.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok
