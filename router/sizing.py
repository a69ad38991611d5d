"""How many KV tokens a request needs: prompt tokens plus the output it may generate, times its sequences.

Prompt tokens come from a real tokenizer (``tokenizers``, a ``tokenizer.json``) when configured, else from a
byte estimate multiplied by a safety factor (over-reserving costs a little capacity; under-reserving costs a
preemption of the whole lockstep batch). The output reservation is the request's own limit, or a configured
default (which the gateway writes into the forwarded body, so the engine cannot exceed it), clamped to the
context window, times ``n`` and the batch size. Page rounding is :meth:`RequestShape.reserve_tokens`'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, cast

MAX_N = 128


class SizingError(ValueError):
    """The request cannot be sized or can never run (400, ``param`` names the culprit)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class _Tokenizer(Protocol):
    def encode(self, sequence: str, add_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True, slots=True)
class Sized:
    """``prompt_tokens`` is summed over distinct prompts, ``output_tokens`` over all sequences (batch x n)."""

    prompt_tokens: int
    output_tokens: int
    sequences: int
    output_limit_tokens: int  # per sequence, after clamping
    limit_given: bool  # the request set its own output limit
    exact: bool  # prompt counted by a tokenizer or given as token ids


@dataclass(frozen=True, slots=True)
class _Prompt:
    per_sequence_tokens: tuple[int, ...]
    exact: bool


def load_tokenizer(path: str) -> _Tokenizer:
    """A ``tokenizers`` tokenizer from a tokenizer.json file (or a directory holding one)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception on bad files
        raise ValueError(f"cannot load tokenizer {str(p)!r}: {exc}") from None
    return cast(_Tokenizer, tok)


def _int_field(body: dict[str, Any], name: str, param: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SizingError(f"'{param}' must be an integer >= {low}", param=param)
    return value


class Sizer:
    def __init__(
        self,
        default_max_tokens: int,
        bytes_per_token: float = 4.0,
        safety_factor: float = 1.25,
        message_overhead_tokens: int = 4,
        tokenizer: _Tokenizer | None = None,
    ) -> None:
        self.default_max_tokens = default_max_tokens
        self.bytes_per_token = bytes_per_token
        self.safety_factor = safety_factor
        self.message_overhead_tokens = message_overhead_tokens
        self.tokenizer = tokenizer

    def count_text(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "replace"))
        return math.ceil(n_bytes / self.bytes_per_token * self.safety_factor)

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    # -- prompts ------------------------------------------------------------------------------------------

    def _text_or_ids(self, value: Any, param: str) -> _Prompt:
        """A string, a list of strings, a token-id list, or a list of token-id lists."""
        if isinstance(value, str):
            return _Prompt((self.count_text(value),), self.exact)
        if isinstance(value, list) and value:
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return _Prompt((len(value),), True)
            if all(isinstance(v, str) for v in value):
                return _Prompt(tuple(self.count_text(v) for v in value), self.exact)
            if all(isinstance(v, list) and all(isinstance(t, int) for t in v) for v in value):
                return _Prompt(tuple(len(v) for v in value), True)
        raise SizingError(
            f"'{param}' must be a non-empty string, list of strings or list of token ids", param
        )

    def _chat_prompt(self, body: dict[str, Any]) -> _Prompt:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SizingError("'messages' must be a non-empty list", param="messages")
        total = 0
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise SizingError(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
            total += self.message_overhead_tokens + self._content_tokens(msg.get("content"), i)
        tools = body.get("tools")
        if tools:
            import orjson

            total += self.count_text(orjson.dumps(tools).decode())
        return _Prompt((total,), self.exact)

    def _content_tokens(self, content: Any, index: int) -> int:
        if content is None:
            return 0
        if isinstance(content, str):
            return self.count_text(content)
        if isinstance(content, list):
            # Multi-part content: only text parts carry prompt tokens for a text model.
            return sum(
                self.count_text(part["text"])
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
        raise SizingError(
            f"messages[{index}].content must be a string or a list of parts", f"messages[{index}]"
        )

    def prompt(self, route: str, body: dict[str, Any]) -> _Prompt:
        if route == "/v1/chat/completions":
            return self._chat_prompt(body)
        if route == "/v1/completions":
            if body.get("prompt") is None:
                raise SizingError("'prompt' is required", param="prompt")
            return self._text_or_ids(body["prompt"], "prompt")
        if body.get("input_ids") is not None:
            return self._text_or_ids(body["input_ids"], "input_ids")
        if body.get("text") is None:
            raise SizingError("one of 'text' or 'input_ids' is required", param="text")
        return self._text_or_ids(body["text"], "text")

    # -- outputs -------------------------------------------------------------------------------------------

    @staticmethod
    def output_limit(route: str, body: dict[str, Any]) -> tuple[int | None, int]:
        """(requested output tokens per sequence or None, n)."""
        if route == "/generate":
            params = body.get("sampling_params")
            params = {} if params is None else params
            if not isinstance(params, dict):
                raise SizingError("'sampling_params' must be an object", param="sampling_params")
            limit = _int_field(params, "max_new_tokens", "sampling_params.max_new_tokens", 0)
            n = _int_field(params, "n", "sampling_params.n", 1) or 1
        else:
            limit = _int_field(body, "max_completion_tokens", "max_completion_tokens", 0)
            if limit is None:
                limit = _int_field(body, "max_tokens", "max_tokens", 0)
            n = _int_field(body, "n", "n", 1) or 1
        if n > MAX_N:
            raise SizingError(f"'n' must be <= {MAX_N}", param="n")
        return limit, n

    def size(
        self, route: str, body: dict[str, Any], context_tokens: int, capacity_tokens: int | None = None
    ) -> Sized:
        """Size a parsed request for a deployment whose context window is ``context_tokens`` and whose
        largest rank holds ``capacity_tokens`` (None: unknown)."""
        prompt = self.prompt(route, body)
        limit, n = self.output_limit(route, body)
        longest = max(prompt.per_sequence_tokens)
        # An estimate is inflated by the safety factor; refuse only on what the prompt surely holds.
        surely = longest if prompt.exact else math.floor(longest / self.safety_factor)
        if surely >= context_tokens:
            raise SizingError(
                f"The prompt ({surely} tokens) is longer than the model's context window "
                f"({context_tokens} tokens).",
                param="messages" if route == "/v1/chat/completions" else "prompt",
                code="context_length_exceeded",
            )
        room = max(1, context_tokens - surely)  # the safety factor must not cut the client's output short
        per_seq = min(self.default_max_tokens if limit is None else limit, room)
        sequences = len(prompt.per_sequence_tokens) * n
        # The engine holds at most the context window for one sequence: an inflated estimate reserves no
        # more (a prompt that fits would otherwise be refused as too large for every rank).
        prompt_cap = context_tokens - per_seq
        # n samples of one prompt share its prefix pages in both engines; outputs are per sample.
        prompt_tokens = sum(min(t, prompt_cap) for t in prompt.per_sequence_tokens)
        output_tokens = per_seq * sequences
        if not prompt.exact and capacity_tokens is not None:
            # Likewise for the largest rank: a request the unscaled estimate fits there is not refused
            # for its safety margin; it reserves the rank's room (at least what it surely holds).
            surely_total = sum(math.floor(t / self.safety_factor) for t in prompt.per_sequence_tokens)
            prompt_tokens = max(surely_total, min(prompt_tokens, capacity_tokens - output_tokens))
        return Sized(
            prompt_tokens=prompt_tokens,
            output_tokens=output_tokens,
            sequences=sequences,
            output_limit_tokens=per_seq,
            limit_given=limit is not None,
            exact=prompt.exact,
        )
