"""Length scaling: shrink trace lengths so that they fit a small model's context.

The Azure traces' prompts reach 2,000 tokens after Weaver's filter, more than a small CPU
model's `max_model_len` may allow; multiplying both lengths by one factor keeps the
input/output mix (prefill- vs decode-heavy) while fitting.
"""

from __future__ import annotations


def scale_lengths(
    input_tokens: int, output_tokens: int, factor: float = 1.0, max_model_len: int | None = None
) -> tuple[int, int]:
    """Multiply both lengths by `factor` (rounded, at least 1 each), then, if their sum exceeds
    `max_model_len`, shrink both in proportion so that input + output <= max_model_len."""
    if not factor > 0:
        raise ValueError(f"length scale factor must be > 0, got {factor}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(
            f"max_model_len must be >= 2 (one prompt and one output token), got {max_model_len}"
        )
    num_in = max(1, round(input_tokens * factor))
    num_out = max(1, round(output_tokens * factor))
    if max_model_len is not None and num_in + num_out > max_model_len:
        # Proportional shrink keeps the request's prefill/decode balance.
        num_in = min(max_model_len - 1, max(1, num_in * max_model_len // (num_in + num_out)))
        num_out = max(1, max_model_len - num_in)
    return num_in, num_out
