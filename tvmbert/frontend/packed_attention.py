"""The torch side of a packed build (``deploy/packing.py``): the same transformers model on one
stream of real tokens, its attention per sequence, for torch.export to trace."""

from __future__ import annotations

from tvmbert.core.families import FAMILIES, TASKS
from tvmbert.frontend.models import ModelSource, load

PACKED_ATTENTION = "tvmbert_packed"  # the name it is registered under in transformers' AttentionInterface


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, token_slot=None, gather_index=None,
                      **kwargs):
    """Attention per sequence for a packed stream (packing.py): q, k, v [1, heads, T, d] gathered
    into the [batch, seq_len] slot grid, eager attention there under the grid's additive key mask,
    and each token's row scattered back to the stream, [1, T, heads, d]. Eval only (no dropout)."""
    import torch

    batch, seq_len = gather_index.shape
    flat = gather_index.reshape(-1)
    q, k, v = (x[0].index_select(1, flat).reshape(x.shape[1], batch, seq_len, x.shape[3]).transpose(0, 1)
               for x in (query, key, value))
    weights = torch.matmul(q, k.transpose(2, 3)) * (q.size(-1) ** -0.5 if scaling is None else scaling) + attention_mask
    out = torch.matmul(torch.nn.functional.softmax(weights, dim=-1), v).transpose(1, 2)  # [batch, seq_len, heads, d]
    return out.reshape(batch * seq_len, *out.shape[2:]).index_select(0, token_slot)[None], None


def load_packed(source: ModelSource, dtype: str = "float32", seed: int = 0):
    """The model as a packed build runs it (packing.py): the same transformers model on a [1, T]
    token stream, its attention per sequence through ``_packed_attention``. Positional inputs
    ``packing.input_names``; returns per-token outputs [T, ...] and the pooler's [batch, hidden].
    ``.positions`` says how the loader numbers positions for it."""
    import torch
    from transformers import AttentionInterface

    from tvmbert.deploy.packing import input_names

    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    task_outputs = load(source, dtype, seed)
    model, family = task_outputs.model, FAMILIES[source.family]
    model.config._attn_implementation = PACKED_ATTENTION
    per_token = TASKS[source.task].per_token

    class PackedOutputs(torch.nn.Module):
        """The family's model on the stream; the pooler on each sequence's first token."""

        def __init__(self):
            super().__init__()
            self.model, self.input_names, self.output_names = model, input_names(source.inputs), task_outputs.output_names
            self.random_weights = task_outputs.random_weights
            self.positions = {"rule": family.positions, "pad": int(getattr(model.base_model.embeddings, "padding_idx", None) or 0)}

        def forward(self, input_ids, position_ids, token_slot, gather_index, key_mask, token_type_ids=None):
            """Named as the compiled model's inputs are (torch.export takes the names from here)."""
            mask = family.packed_mask(self.model.config, key_mask, self.model.dtype)
            given = {"input_ids": input_ids[None], "position_ids": position_ids[None]}
            if token_type_ids is not None:
                given["token_type_ids"] = token_type_ids[None]
            out = self.model(**given, attention_mask=mask, token_slot=token_slot, gather_index=gather_index)
            results = []
            for name in self.output_names:
                if name in per_token:
                    results.append(out[name][0])
                else:  # pooler_output (the one per-sequence output of a packable task)
                    first = out["last_hidden_state"][0].index_select(0, gather_index[:, 0])
                    results.append(family.pool(self.model.base_model, first))
            return tuple(results)

    return PackedOutputs().eval()
