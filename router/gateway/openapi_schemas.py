"""Request-body schemas for the generation routes, for the OpenAPI document only.

The routes read raw bodies (parsed once with orjson, validated by the sizer and the proxy), so FastAPI
never sees these: they tell clients, and the schema fuzzer in tests/test_hardening_fuzz.py, what a
request looks like. Fields the router does not read are passed to the engine untouched
(``additionalProperties``), as the engines' own OpenAI servers accept extensions.
"""

from __future__ import annotations

from typing import Any

_TOKENS = {"type": ["integer", "null"], "minimum": 1}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": _TOKENS,
    "n": {"type": "integer", "minimum": 1, "maximum": 128},
    "stream": {"type": "boolean"},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
}
_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _PART}, {"type": "null"}]},
    },
}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

CHAT_COMPLETION: dict[str, Any] = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": _TOKENS,
    },
}
COMPLETION: dict[str, Any] = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        },
    },
}
GENERATE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "text": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]
        },
        "input_ids": _TOKEN_IDS,
        "sampling_params": {
            "type": "object",
            "properties": {
                "max_new_tokens": {"type": "integer", "minimum": 0},
                "temperature": {"type": "number", "minimum": 0},
            },
        },
        "stream": {"type": "boolean"},
    },
}


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose body is read by hand."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
