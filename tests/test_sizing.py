"""Request sizing: prompt counts (tokenizer or byte estimate), output reservation, clamping, n, refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from router.sizing import Sizer, SizingError, load_tokenizer


def est(**kw: float) -> Sizer:
    return Sizer(
        default_max_tokens=100, bytes_per_token=4.0, safety_factor=1.25, message_overhead_tokens=4, **kw
    )  # type: ignore[arg-type]


def test_byte_estimate_applies_safety_factor_and_utf8_bytes() -> None:
    s = est()
    assert s.count_text("a" * 400) == 125
    assert s.count_text("é" * 100) == math.ceil(200 / 4 * 1.25)  # 2 bytes per char in UTF-8


def test_chat_counts_every_message_plus_overhead_and_text_parts() -> None:
    s = est()
    body = {
        "messages": [
            {"role": "system", "content": "a" * 40},
            {"role": "user", "content": [{"type": "text", "text": "b" * 80}, {"type": "image_url"}]},
            {"role": "assistant", "content": None},
        ],
        "max_tokens": 10,
    }
    sized = s.size("/v1/chat/completions", body, 4096)
    assert sized.prompt_tokens == 3 * 4 + s.count_text("a" * 40) + s.count_text("b" * 80)
    assert sized.output_tokens == 10 and sized.limit_given


def test_output_limits_by_route_and_default() -> None:
    s = est()
    assert s.size("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                            "max_completion_tokens": 7}, 4096).output_tokens == 7  # fmt: skip
    assert s.size("/v1/completions", {"prompt": "x", "max_tokens": 9}, 4096).output_tokens == 9
    gen = s.size("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 11}}, 4096)
    assert gen.output_tokens == 11
    default = s.size("/v1/completions", {"prompt": "x"}, 4096)
    assert default.output_tokens == 100 and not default.limit_given


def test_n_and_batches_multiply_outputs_not_the_shared_prompt() -> None:
    s = est()
    one = s.size("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "n": 4}, 4096)
    assert (one.prompt_tokens, one.output_tokens, one.sequences, one.exact) == (3, 20, 4, True)
    batch = s.size("/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 5}, 4096)
    assert (batch.prompt_tokens, batch.output_tokens, batch.sequences) == (5, 10, 2)
    gen = s.size("/generate", {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 3, "n": 2}}, 4096)
    assert (gen.prompt_tokens, gen.output_tokens) == (10, 6)


def test_output_is_clamped_to_the_context_window() -> None:
    s = est()
    sized = s.size("/v1/completions", {"prompt": list(range(1000)), "max_tokens": 5000}, 1024)
    assert sized.output_limit_tokens == 24 and sized.output_tokens == 24


def test_prompt_longer_than_context_is_refused() -> None:
    s = est()
    with pytest.raises(SizingError) as info:
        s.size("/v1/completions", {"prompt": list(range(2000))}, 1024)
    assert info.value.code == "context_length_exceeded"


def test_estimate_refuses_only_what_surely_exceeds_the_context() -> None:
    # 4,000 bytes ~ 1,000 tokens; x1.25 = 1,250 > 1,100, but the estimate alone must not refuse it.
    sized = est().size("/v1/completions", {"prompt": "a" * 4000, "max_tokens": 10}, 1100)
    assert sized.output_tokens == 10  # room from the unscaled estimate (1,000 tokens): the limit stands
    assert sized.prompt_tokens + sized.output_tokens == 1100  # clamped to what one sequence can hold


def test_inflated_estimate_reserves_at_most_the_context_window() -> None:
    # The bench's long-context-mix case: ~128k real tokens in a 163,840-token window. The estimate x1.25
    # (~164k) exceeds the window; the reservation must stop at the window (the engine cannot hold more
    # for one sequence), and the request must not be refused.
    context_tokens = 163_840
    body = {"messages": [{"role": "user", "content": "word " * 105_000}], "max_tokens": 2000}
    sized = est().size("/v1/chat/completions", body, context_tokens)
    assert est().count_text("word " * 105_000) > context_tokens  # the inflated estimate alone overflows
    assert sized.sequences == 1 and sized.output_limit_tokens == 2000  # the client's limit, not cut
    assert sized.prompt_tokens + sized.output_tokens == context_tokens


def test_clamp_applies_per_sequence_of_a_batch() -> None:
    body = {"prompt": ["a" * 4000, "b" * 40], "max_tokens": 10}
    sized = est().size("/v1/completions", body, 1100)
    # per sequence: min(prompt, window - output); the short prompt keeps its own estimate
    assert sized.prompt_tokens == (1100 - sized.output_limit_tokens) + est().count_text("b" * 40)
    assert sized.prompt_tokens + sized.output_tokens <= 2 * 1100


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0]"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 1000}, "n"),
        ("/generate", {}, "text"),
        ("/generate", {"text": "x", "sampling_params": []}, "sampling_params"),
    ],
)
def test_bad_requests_name_the_parameter(route: str, body: dict[str, object], param: str) -> None:
    with pytest.raises(SizingError) as info:
        est().size(route, body, 4096)
    assert info.value.param == param


def test_real_tokenizer_counts_exactly(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    s = Sizer(default_max_tokens=8, tokenizer=load_tokenizer(str(tmp_path)))
    sized = s.size("/v1/completions", {"prompt": "hello world hello"}, 4096)
    assert sized.prompt_tokens == 3 and sized.exact
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_inflated_estimate_is_clamped_to_the_largest_rank() -> None:
    # The bench's case: a ~128k-token prompt on ranks of 153k tokens (KV pools x0.3). x1.25 (~160k) is
    # more than any rank holds; the unscaled estimate (128k) + output fits, so it must reserve the rank.
    body = {"prompt": "abcd" * 128_000, "max_tokens": 4000}
    sized = est().size("/v1/completions", body, 163_840, capacity_tokens=153_000)
    assert sized.output_tokens == 4000
    assert sized.prompt_tokens + sized.output_tokens == 153_000
    # What the prompt surely holds is never clamped away: such a request stays too large (refused later).
    big = est().size("/v1/completions", {"prompt": "abcd" * 152_000, "max_tokens": 4000}, 163_840, 153_000)
    assert big.prompt_tokens == 152_000
    # Exact counts are never touched by the margin logic.
    exact = est().size("/v1/completions", {"prompt": [1] * 150_000, "max_tokens": 4000}, 163_840, 153_000)
    assert exact.prompt_tokens == 150_000
