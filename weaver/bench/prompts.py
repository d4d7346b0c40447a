"""Synthetic prompts of about N tokens, for servers whose tokenizer we do not load.

Each word below is a single token (with its leading space) in the GPT-2/Llama/Qwen BPE
vocabularies, so N words make about N tokens; the server's reported `usage.prompt_tokens`
is recorded next to the requested length. Words are drawn per request id, so prompts do
not share prefixes and prefix caching cannot make TTFT look better than it is. A sweep
sends the same request ids again at every rate to one server; its runs pass a different
`salt` each, or the later rates would find the earlier rates' prompts in the prefix cache.
"""

from __future__ import annotations

import random

# fmt: off
COMMON_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "they", "you", "were", "her", "she", "there", "been", "one", "all", "we", "their", "has",
    "would", "when", "if", "so", "no", "will", "more", "time", "can", "said", "what", "about",
    "up", "out", "them", "into", "only", "its", "some", "could", "new", "other", "then",
    "these", "two", "may", "first", "any", "like", "now", "my", "over", "such", "our", "man",
    "me", "even", "most", "made", "after", "also", "did", "many", "off", "before", "must",
    "well", "back", "through", "years", "much", "where", "your", "way", "down",
)
# fmt: on


def synthetic_prompt(num_tokens: int, request_id: int = 0, salt: int = 0) -> str:
    """About `num_tokens` tokens of common words; the same (id, salt) always gives the same
    text, another salt another text."""
    if num_tokens < 1:
        raise ValueError(f"a prompt needs at least one token, got {num_tokens}")
    # A local generator: no global random state touched. Salt 0 keeps the texts that
    # results written before the salt existed were measured with.
    seed = request_id if salt == 0 else f"{salt}/{request_id}"
    rng = random.Random(seed)
    return " ".join(rng.choice(COMMON_WORDS) for _ in range(num_tokens))
