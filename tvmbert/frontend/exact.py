"""Where transformers computes in float32 whatever the model's dtype, made exact for a build.

ModernBERT's rotary cos/sin and DeBERTa's relative-position buckets depend on positions, never on
the tokens. transformers computes them in float32 on every forward (the buckets through a float32
log and ceil); a build would redo that arithmetic with TVM's own cos, sin and log, one rounding
apart from torch's, and a bucket off by one at a ceil is a wrong result. Made here with
transformers' own code, once for every position the model takes, they are buffers the model reads
by position: the same numbers in the build and in the reference, folded to constants at a fixed
sequence length. Each table is a ``Family.position_tables`` key.

ModernBERT's eager attention takes its softmax in float32 in every dtype: a float64 model gets
``FLOAT64_ATTENTION`` instead, the same attention with its softmax in float64, so that float64
verifies the build's arithmetic rather than two float32 exps.
"""

from __future__ import annotations


def _rotary(base, max_positions: int) -> None:
    """ModernBERT: each layer type's cos and sin, [positions, head_dim] in float32 as transformers
    makes them, cast to the model's dtype where read (as transformers casts them)."""
    import torch

    rotary = base.rotary_emb
    positions = torch.arange(max_positions)[None]
    probe = torch.zeros((), dtype=torch.float32)
    with torch.no_grad():
        for layer_type in rotary.layer_types:
            cos, sin = rotary(probe, positions, layer_type)
            rotary.register_buffer(f"{layer_type}_cos_table", cos[0], persistent=False)
            rotary.register_buffer(f"{layer_type}_sin_table", sin[0], persistent=False)

    def by_position(x, position_ids, layer_type):
        cos, sin = (getattr(rotary, f"{layer_type}_{part}_table") for part in ("cos", "sin"))
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    rotary.forward = by_position


def _relative_buckets(base, max_positions: int) -> None:
    """DeBERTa: the relative-position bucket of every (query, key) position pair, [1, P, P]; a
    sequence of n tokens reads its top-left n x n (a bucket depends on the positions' difference)."""
    import torch

    encoder = base.encoder
    if not encoder.relative_attention:
        return
    with torch.no_grad():
        buckets = encoder.get_rel_pos(torch.zeros(1, max_positions, 1))
    encoder.register_buffer("relative_position_buckets", buckets, persistent=False)

    def by_position(hidden_states, query_states=None, relative_pos=None):
        if relative_pos is not None:
            return relative_pos
        queries = (hidden_states if query_states is None else query_states).size(-2)
        return encoder.relative_position_buckets[:, :queries, : hidden_states.size(-2)]

    encoder.get_rel_pos = by_position


POSITION_TABLES = {"rotary": _rotary, "relative-buckets": _relative_buckets}


FLOAT64_ATTENTION = "tvmbert_eager_float64"  # its name in transformers' AttentionInterface


def _eager_attention_float64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention (ModernBERT's), its softmax in the query's dtype. Eval only."""
    import torch

    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def float64_attention() -> str:
    """Registers ``FLOAT64_ATTENTION`` with transformers, with eager attention's masks, and returns
    its name. (transformers makes no mask at all for an attention it has no mask function for:
    every key, padding included, and ModernBERT's local layers without their window.)"""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FLOAT64_ATTENTION, _eager_attention_float64)
    AttentionMaskInterface.register(FLOAT64_ATTENTION, eager_mask)
    return FLOAT64_ATTENTION
