"""The shape of a random-weight Llama model: the numbers that differ between test models.

Pure data: importing this module pulls in neither torch nor transformers.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

# The SmolLM2 tokenizer that random models reuse has 49152 ids; a smaller embedding table
# would make the tokenizer emit ids the model cannot look up.
TOKENIZER_VOCAB_SIZE = 49152

# Head sizes vLLM 0.32.0's CPU attention accepts
# (vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend.get_supported_head_sizes).
# tests/models/test_shapes.py checks this copy against the installed vLLM.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

DEFAULT_MAX_POSITION_EMBEDDINGS = 4096
# Wider than the 0.02 used to start training: with 0.02 the attention scores are so small
# that attention is nearly uniform, greedy text repeats one token, and top-1 logit margins
# fall to ~1e-5. At 0.1 the text varies, depends on the whole prompt, and the margins
# (>= ~3e-4 over 64 greedy steps of each preset) leave room for the rounding differences
# between attention kernels when outputs are compared token by token.
DEFAULT_INIT_STD = 0.1

# Names end up as directory names in the models cache.
_NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


def check_model_name(name: str) -> None:
    """Raise ValueError unless `name` is usable as a model name (and a directory name)."""
    if not _NAME_PATTERN.match(name):
        raise ValueError(
            f"model name {name!r} is not allowed: use 1-100 lower-case letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )


@dataclass(frozen=True)
class LlamaShape:
    """Architecture and initialisation of one random-weight Llama model.

    `hidden_size` need not equal `num_q_heads * head_size`: Llama's `head_dim` config field
    decouples them (q/k/v project hidden -> heads * head_size, o_proj projects back).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    intermediate_size: int
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    vocab_size: int = TOKENIZER_VOCAB_SIZE
    seed: int = 0
    init_std: float = DEFAULT_INIT_STD
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_size",
            "hidden_size",
            "intermediate_size",
            "max_position_embeddings",
        ):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be a positive integer, got {value!r}")
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}): each KV head serves a whole group of query heads"
            )
        if self.head_size % 2 != 0:
            raise ValueError(f"head_size must be even for rotary embeddings, got {self.head_size}")
        if self.vocab_size < TOKENIZER_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size must be at least {TOKENIZER_VOCAB_SIZE} (the SmolLM2 tokenizer's), "
                f"got {self.vocab_size}"
            )
        if not self.init_std > 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")

    @property
    def is_vllm_cpu_compatible(self) -> bool:
        """Whether vLLM's CPU attention backend supports this head size."""
        return self.head_size in VLLM_CPU_HEAD_SIZES

    @property
    def num_params(self) -> int:
        """Parameter count (untied embedding and LM head, no biases)."""
        q_size = self.num_q_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        attention = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        per_layer = attention + mlp + norms
        embeddings = 2 * self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def default_name(self) -> str:
        """A cache name that spells out the shape, for models built from an ad-hoc shape."""
        return (
            f"random-llama-l{self.num_layers}-q{self.num_q_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_size}-h{self.hidden_size}-i{self.intermediate_size}-s{self.seed}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_hf_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for transformers' LlamaConfig."""
        return {
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "initializer_range": self.init_std,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            # Untied: with a tied LM head a random model mostly predicts its input token
            # back (the final hidden state stays close to that token's embedding).
            "tie_word_embeddings": False,
        }
