"""Tensors grouped by block and kind, so a model with hundreds of tensors reads as its layers.

A name is cut at its first numeric component: ``transformer.h.3.attn.c_attn.weight`` is in
block ``transformer.h.3`` (a ``ModuleList`` index is how PyTorch models number their layers);
a name without one (``transformer.wte.weight``, ``lm_head.weight``) is in its top-level module.
Its *kind* is read from the module path: attention, mlp, norm, embedding, head, other. The rules
are name patterns only (no model code is loaded); ``embeddings`` (the run's
``layout.embeddings``, what ``nn.Embedding`` owns) wins over them. A name that matches nothing
is ``other``: the grouping orders and folds rows, it never hides one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

#: Kinds in the order the page lists them within a block.
KINDS = ("embedding", "attention", "mlp", "norm", "head", "other")

# Module-path words (between dots, lower case) per kind; the first kind with a match wins,
# checked from the innermost module outwards (``h.0.attn.c_proj`` is attention, ``h.0.mlp.c_proj`` mlp).
_WORDS: dict[str, tuple[str, ...]] = {
    "embedding": ("wte", "wpe", "embed", "embeds", "embedding", "embeddings", "embed_tokens", "tok_embeddings",
                  "word_embeddings", "position_embeddings", "token_type_embeddings", "pos_emb", "tok_emb",
                  "embed_positions", "shared"),
    "norm": ("ln", "ln_1", "ln_2", "ln_f", "norm", "norm1", "norm2", "norm_f", "layernorm", "layer_norm",
             "rmsnorm", "bn", "bn1", "bn2", "batchnorm", "input_layernorm", "post_attention_layernorm",
             "final_layernorm", "final_layer_norm", "attention_norm", "ffn_norm", "groupnorm", "gn"),
    "attention": ("attn", "attention", "self_attn", "self_attention", "cross_attn", "crossattention", "c_attn",
                  "q_proj", "k_proj", "v_proj", "o_proj", "qkv", "query", "key", "value", "wq", "wk", "wv",
                  "wo", "in_proj", "out_proj", "mha"),
    "mlp": ("mlp", "ffn", "feed_forward", "feedforward", "fc", "fc1", "fc2", "c_fc", "up_proj", "down_proj",
            "gate_proj", "intermediate", "w1", "w2", "w3", "experts", "moe"),
    "head": ("lm_head", "head", "classifier", "score", "output", "fc_out", "logits", "decoder"),
}
_BY_WORD = {w: k for k in ("embedding", "norm", "attention", "mlp", "head") for w in _WORDS[k]}
_PREFIX = re.compile(r"^(ln|norm|bn|attn|mlp|ffn|embed|emb|head)(\d+|_.*)?$")


def kind_of(name: str, embeddings: Iterable[str] = ()) -> str:
    """The kind of tensor ``name`` (one of :data:`KINDS`), see the module docstring."""
    if name in set(embeddings):
        return "embedding"
    parts = [p.lower() for p in name.split(".")[:-1]]  # the module path, without weight/bias
    in_block = any(p.isdigit() for p in parts)  # "output" inside a layer is a projection, not the head
    for p in reversed(parts):
        k = _BY_WORD.get(p)
        if k == "head" and in_block:
            continue
        if k is None:
            m = _PREFIX.match(p)
            if m:
                k = {"ln": "norm", "bn": "norm", "attn": "attention", "ffn": "mlp", "emb": "embedding"}.get(
                    m.group(1), m.group(1) if m.group(1) in KINDS else "embedding" if m.group(1) == "embed" else None)
        if k is not None:
            return k
    return "other"


def block_of(name: str) -> str:
    """The block of tensor ``name``: the path up to its first numeric component, else its top module."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else "(top level)"


def _block_key(block: str) -> tuple[Any, ...]:
    """Natural order: ``h.2`` before ``h.10``."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in block.split("."))


def tensor_groups(names: Sequence[str], embeddings: Iterable[str] = ()) -> dict[str, Any]:
    """How the page groups ``names``: blocks in the model's order, each tensor's block and kind.

    Returns:
        ``{"blocks": [block, ...], "block": {name: block}, "kind": {name: kind}, "order": [name, ...]}``:
        ``order`` lists the names block by block (blocks in first-appearance order, numbered blocks of
        one list in index order), within a block in recording order.
    """
    emb = set(embeddings)
    block = {n: block_of(n) for n in names}
    kind = {n: kind_of(n, emb) for n in names}
    first: dict[str, int] = {}
    for i, n in enumerate(names):
        first.setdefault(block[n], i)

    def stem(b: str) -> str:  # numbered blocks of one ModuleList sort by index, at the list's first place
        return b.rsplit(".", 1)[0] if b.rsplit(".", 1)[-1].isdigit() else b

    stem_first: dict[str, int] = {}
    for b, i in first.items():
        stem_first[stem(b)] = min(stem_first.get(stem(b), i), i)
    blocks = sorted(first, key=lambda b: (stem_first[stem(b)], _block_key(b)))
    rank = {b: i for i, b in enumerate(blocks)}
    order = sorted(names, key=lambda n: (rank[block[n]], names.index(n)))
    return {"blocks": blocks, "block": block, "kind": kind, "order": order}
