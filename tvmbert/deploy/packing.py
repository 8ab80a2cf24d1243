"""Padding-free batches: the rows of a batch as one stream of their real tokens, and back.

A packed build (``--tokens T``) runs the token-wise layers (embeddings, projections, FFN, layer
norms: nearly all the FLOPs) on a [T] stream of the rows' tokens laid end to end, and only the
attention per sequence: it gathers each row's keys and values into a [batch, seq_len] slot grid,
masked as the padded model masks them, and scatters the result back to the stream. This module
lays the stream out with NumPy alone: the torch-free loader, verify and bench share it.

Inputs of a packed build, in order (``input_names``): the stream's ``input_ids`` and
``position_ids``; ``token_slot`` [T], each token's slot row * seq_len + position;
``gather_index`` [batch, seq_len], each slot's token; ``key_mask`` [batch, seq_len], the row's
attention mask at that slot (0 past its length); the stream's ``token_type_ids`` (families that
have them). Stream tokens past the rows' own are zeros, and no slot points at them: they never
reach a real token.
"""

from __future__ import annotations

import numpy as np

from tvmbert.core.errors import InputError

MASK = "attention_mask"
STREAM_INPUTS = ("input_ids", "token_type_ids")  # the family's inputs that become streams


def _index_positions(ids: np.ndarray, pad: int) -> np.ndarray:
    return np.arange(len(ids), dtype=np.int64)


def _non_pad_positions(ids: np.ndarray, pad: int) -> np.ndarray:
    """RoBERTa's: pad + 1 + the count of non-pad tokens up to here; pad tokens at pad."""
    real = ids != pad
    return (np.cumsum(real) * real + pad).astype(np.int64)


# How a family numbers positions from a row's ids (families.Family.positions): what the padded
# model computes, so the packed one sees the same position embeddings.
POSITIONS = {"index": _index_positions, "non-pad-count": _non_pad_positions}


def input_names(family_inputs: tuple[str, ...]) -> tuple[str, ...]:
    """A packed build's inputs, in the order its main takes them."""
    return ("input_ids", "position_ids", "token_slot", "gather_index", "key_mask",
            *(("token_type_ids",) if "token_type_ids" in family_inputs else ()))


def lengths(mask: np.ndarray | None, shape: tuple[int, int]) -> np.ndarray:
    """Each row's length up to its last unmasked token; a row masked whole keeps the full
    length (its output depends on how many masked positions there are)."""
    if mask is None:
        return np.full(shape[0], shape[1])
    unmasked = mask.astype(bool)
    last = shape[1] - np.argmax(unmasked[:, ::-1], axis=1)
    return np.where(unmasked.any(axis=1), last, shape[1])


def check_fits(mask: np.ndarray, row_lengths, batch: int, seq_len: int, tokens: int) -> None:
    """A packed build takes at most ``batch`` rows of at most ``seq_len`` and ``tokens`` tokens in
    all, each with an unmasked token: a row masked whole averages over its padding, which only a
    padded build reproduces."""
    if len(row_lengths) > batch or max(row_lengths) > seq_len:
        raise InputError(f"{len(row_lengths)} rows of up to {max(row_lengths)} tokens: this packed build takes at most "
                         f"{batch} rows of at most {seq_len}")
    if sum(row_lengths) > tokens:
        raise InputError(f"the rows hold {sum(row_lengths)} tokens: this packed build takes at most {tokens} "
                         "(build one with a larger --tokens)")
    whole = [row for row in range(len(row_lengths)) if not mask[row].any()]
    if whole:
        raise InputError(f"row {whole[0]} is masked whole: a packed build cannot serve it (its output depends on the padding); "
                         "use a padded build")


def pack(rows: dict[str, np.ndarray], row_lengths, batch: int, seq_len: int, tokens: int, positions: dict) -> dict[str, np.ndarray]:
    """The packed build's inputs by name from padded rows [rows, >= length] of the family's
    inputs. ``positions``: {"rule": a POSITIONS key, "pad": the pad id it uses}."""
    number = POSITIONS[positions["rule"]]
    stream = {name: np.zeros(tokens, np.int64) for name in ("input_ids", "position_ids", "token_type_ids") if name != "token_type_ids" or name in rows}
    token_slot = np.zeros(tokens, np.int64)
    gather_index = np.zeros((batch, seq_len), np.int64)
    key_mask = np.zeros((batch, seq_len), np.int64)
    start = 0
    for row, length in enumerate(row_lengths):
        end = start + int(length)
        for name in STREAM_INPUTS:
            if name in rows:
                stream[name][start:end] = rows[name][row, :length]
        stream["position_ids"][start:end] = number(rows["input_ids"][row, :length], positions["pad"])
        token_slot[start:end] = row * seq_len + np.arange(length)
        gather_index[row, :length] = np.arange(start, end)
        key_mask[row, :length] = rows[MASK][row, :length]
        start = end
    return {**stream, "token_slot": token_slot, "gather_index": gather_index, "key_mask": key_mask}


def unpack(values: np.ndarray, row_lengths, seq_len: int) -> np.ndarray:
    """A per-token output [tokens, ...] as [rows, seq_len, ...]: each row's tokens, zeros after."""
    out = np.zeros((len(row_lengths), seq_len, *values.shape[1:]), values.dtype)
    start = 0
    for row, length in enumerate(row_lengths):
        out[row, :length] = values[start : start + length]
        start += int(length)
    return out


def fitting_lengths(batch: int, seq_len: int, tokens: int, rng: np.random.Generator | None = None) -> list[int]:
    """Row lengths in [1, seq_len] with at most ``tokens`` in all: full rows (``rng`` None), or
    random ones with the first row full and the last of length 1; rows shortened from the back
    until they fit."""
    row_lengths = [seq_len] * batch if rng is None else [int(n) for n in rng.integers(1, seq_len + 1, batch)]
    if rng is not None:
        row_lengths[0], row_lengths[-1] = seq_len, 1 if batch > 1 else seq_len
    row = batch - 1
    while sum(row_lengths) > tokens:
        excess = sum(row_lengths) - tokens
        cut = min(excess, row_lengths[row] - 1)
        row_lengths[row] -= cut
        row = (row - 1) % batch
    return row_lengths
