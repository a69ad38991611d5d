"""Synthetic prompts whose token count is known exactly under the byte estimate.

The emulator and the router (without a tokenizer) estimate ``tokens = ceil(len(text.encode()) / 4)``.
A synthetic prompt is made of 4-byte ASCII words (three letters and a space), so a prompt of N tokens is
exactly 4N bytes and estimates to N. Against a real engine, ``/generate`` can carry the same sequence as
``input_ids`` (:func:`synthetic_token_ids`) so the engine sees exactly N tokens.

Prompts of one prefix group share their first ``prefix_tokens`` words (drawn from the group's own
stream), so a prefix cache or prefix-affinity policy can find them; the rest comes from the request's
seed, so two requests never share more than their group prefix.
"""

from __future__ import annotations

import math
import string

import numpy as np
import numpy.typing as npt

BYTES_PER_TOKEN = 4
# Token ids for ``input_ids``: skip the low ids, where tokenizers keep special tokens.
TOKEN_ID_BASE = 1000


def estimate_tokens(text: str) -> int:
    """The byte estimate shared with the emulator: ceil(UTF-8 bytes / 4)."""
    return math.ceil(len(text.encode()) / BYTES_PER_TOKEN)


def _vocabulary() -> npt.NDArray[np.bytes_]:
    letters = string.ascii_lowercase
    words = [f"{a}{b}{c} ".encode() for a in letters for b in "aeiouy" for c in letters]
    return np.array(words, dtype="S4")


_WORDS = _vocabulary()  # a constant table (no state), built once per process


def _word_indices(
    tokens: int, seed: int, prefix_group: int | None, prefix_tokens: int | None, prefix_seed: int
) -> npt.NDArray[np.int64]:
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    shared = 0
    if prefix_group is not None:
        shared = tokens if prefix_tokens is None else max(0, min(prefix_tokens, tokens))
    own_rng = np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, 1]))
    own = own_rng.integers(0, len(_WORDS), size=tokens - shared)
    if not shared:
        return own
    group_rng = np.random.default_rng(np.random.SeedSequence([prefix_seed, int(prefix_group or 0), 2]))
    return np.concatenate((group_rng.integers(0, len(_WORDS), size=shared), own))


def synthetic_prompt(
    tokens: int,
    seed: int,
    prefix_group: int | None = None,
    *,
    prefix_tokens: int | None = None,
    prefix_seed: int = 0,
) -> str:
    """Text of exactly ``tokens`` tokens under :func:`estimate_tokens` (4 * tokens ASCII bytes).

    With ``prefix_group``, the first ``prefix_tokens`` tokens (all of them when None) depend only on
    ``(prefix_seed, prefix_group)``: prompts of one group share that prefix byte for byte.
    """
    idx = _word_indices(tokens, seed, prefix_group, prefix_tokens, prefix_seed)
    return _WORDS[idx].tobytes().decode("ascii")


def synthetic_token_ids(
    tokens: int,
    seed: int,
    prefix_group: int | None = None,
    *,
    prefix_tokens: int | None = None,
    prefix_seed: int = 0,
) -> list[int]:
    """The same sequence as :func:`synthetic_prompt`, as ``tokens`` token ids (for ``/generate``)."""
    idx = _word_indices(tokens, seed, prefix_group, prefix_tokens, prefix_seed)
    return (idx + TOKEN_ID_BASE).tolist()  # type: ignore[no-any-return]
