"""The cold model's layers in Weaver: where poll points go, and operator splitting
(docs/architecture.md, "Operator splitting"; docs/vllm-hooks.md, "Layers").

Poll points follow the operators whose ``forward`` runs on every step in eager mode: the
linear layers, attention and the ``LogitsProcessor`` (the LM head is applied there, not in
``ParallelLMHead.forward``).

A split plan (chunks per operator kind, from :mod:`weaver.splitting`) reaches the engine
in ``additional_config["weaver"]["split"]``. Weaver registers out-of-tree versions of
vLLM's linear layers and of ``LogitsProcessor`` (``PluggableLayer.register_oot``, from the
general plugin, so in every process); each reads the plan when the model is built and,
for an operator kind the plan splits, computes it as chunks along the output dimension
(output features; the vocabulary for the LM head), calling the cold worker's poll
between chunks. Attention splits into groups of whole sequences (``AttentionChunks``,
run by weaver/vllm_ext/attention/backend.py). Without a plan (every hot or dedicated
engine) the layers are vLLM's own.

Why at load time: on CPU, ``UnquantizedLinearMethod.process_weights_after_loading``
prepacks the weight into a oneDNN handle and drops ``layer.weight``
(``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), so each chunk gets its
own prepacked handle when the weights are loaded. The LM head keeps its weight (it is
the tied embedding), and its chunks are packed on the first logits call, which is the
engine's warm-up run. Chunks of an output dimension compute the same dot products as the
whole, so the concatenation equals the unsplit result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from weaver.splitting.algorithm import chunk_bounds
from weaver.splitting.profile import LM_HEAD_NAME
from weaver.vllm_ext.additional_config import split_chunks_of
from weaver.weaving.poll_points import Poll

logger = logging.getLogger(__name__)

# The op kind of a linear layer, from the last part of its vLLM prefix (Llama-family
# names, model_executor/models/llama.py); the names the profile and plan use.
LINEAR_OP_KINDS = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up",
                   "down_proj": "down"}


ATTN_OP_NAME = "attn"

_Chunk = TypeVar("_Chunk")
_Out = TypeVar("_Out")


def attention_layers(runner: Any) -> dict[str, Any]:
    """The model's attention layers by name, as vLLM's forward context holds them."""
    from vllm.model_executor.layers.attention import Attention

    context = runner.compilation_config.static_forward_context
    return {name: layer for name, layer in context.items() if isinstance(layer, Attention)}


def poll_point_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The cold model's operators after which a poll runs."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    kinds = (LinearBase, Attention, LogitsProcessor)
    return [m for m in model.modules() if isinstance(m, kinds)]


def current_split_chunks() -> dict[str, int]:
    """The plan of the engine vLLM is building now (its current config); {} if none."""
    from vllm.config import get_current_vllm_config_or_none

    return split_chunks_of(get_current_vllm_config_or_none())


class ChunkedOperator:
    """An operator the split plan cuts into chunks: the cold worker's poll between two
    chunks, and the counters of calls, chunk calls and polls."""

    def __init__(self, num_chunks: int, op_name: str) -> None:
        self.num_chunks = num_chunks
        self.op_name = op_name
        self.poll: Poll | None = None  # set by the cold worker (worker.weaver_join_pairs)
        self.num_calls = 0
        self.num_chunk_calls = 0
        self.num_polls = 0

    def run_chunks(self, chunks: Sequence[_Chunk], compute: Callable[[_Chunk], _Out]
                   ) -> list[_Out]:
        """compute(chunk) for each chunk in order, the poll between two; one call."""
        results = []
        for i, chunk in enumerate(chunks):
            if i and self.poll is not None:
                self.poll()
                self.num_polls += 1
            results.append(compute(chunk))
        self.num_calls += 1
        self.num_chunk_calls += len(chunks)
        return results

    def stats(self) -> dict[str, int]:
        return {"chunks": self.num_chunks, "calls": self.num_calls,
                "chunk_calls": self.num_chunk_calls, "polls": self.num_polls}


class ChunkedLinear(ChunkedOperator):
    """One linear map, cut along its output rows, one packed GEMM per chunk.

    Built from the unsplit weight [N, K] (and bias [N]); on CPU each chunk goes through
    vLLM's own packing (``dispatch_cpu_unquantized_gemm``), elsewhere chunks are views.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, num_chunks: int,
                 op_name: str) -> None:
        from vllm.platforms import current_platform

        self.bounds = chunk_bounds(weight.shape[0], num_chunks)
        self._parts = [self._make_part(weight[lo:hi], None if bias is None else bias[lo:hi],
                                       current_platform.is_cpu())
                       for lo, hi in self.bounds]
        super().__init__(len(self._parts), op_name)

    @staticmethod
    def _make_part(weight: torch.Tensor, bias: torch.Tensor | None,
                   is_cpu: bool) -> torch.nn.Module:
        part = torch.nn.Module()
        part.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
        part.bias = None if bias is None else torch.nn.Parameter(bias.contiguous(),
                                                                 requires_grad=False)
        if is_cpu:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(part, remove_weight=True)
        else:
            part.cpu_linear = torch.nn.functional.linear
        return part

    def __call__(self, x: torch.Tensor, use_bias: bool) -> torch.Tensor:
        outputs = self.run_chunks(self._parts, lambda part: part.cpu_linear(
            x, part.weight, part.bias if use_bias else None))
        return torch.cat(outputs, dim=-1)


def _split_linear_method_cls() -> type:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class SplitUnquantizedLinearMethod(UnquantizedLinearMethod):
        """``UnquantizedLinearMethod`` whose weight is packed and run as chunks."""

        def __init__(self, num_chunks: int, op_name: str) -> None:
            super().__init__()
            self.num_chunks = num_chunks
            self.op_name = op_name
            self.chunked: ChunkedLinear | None = None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            weight = layer.weight.data
            if self.num_chunks > weight.shape[0]:
                raise ValueError(
                    f"split plan cuts {self.op_name} ({layer.prefix}, {weight.shape[0]} output "
                    f"features) into {self.num_chunks} chunks; lower it to at most "
                    f"{weight.shape[0]}")
            bias = getattr(layer, "bias", None)
            self.chunked = ChunkedLinear(weight, None if bias is None else bias.data,
                                         self.num_chunks, self.op_name)
            # As vLLM does after packing (utils.dispatch_cpu_unquantized_gemm): the
            # chunks hold the weight now.
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=weight.dtype,
                                                          device=weight.device),
                                              requires_grad=False)

        def apply(self, layer: torch.nn.Module, x: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
            assert self.chunked is not None, "apply before process_weights_after_loading"
            return self.chunked(x, use_bias=bias is not None)

    return SplitUnquantizedLinearMethod


def maybe_split_linear(layer: torch.nn.Module, chunks: dict[str, int] | None = None) -> None:
    """Give ``layer`` a chunked quant method if the plan splits its kind."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    chunks = current_split_chunks() if chunks is None else chunks
    op_name = LINEAR_OP_KINDS.get(getattr(layer, "prefix", "").rsplit(".", 1)[-1])
    num_chunks = chunks.get(op_name, 1) if op_name else 1
    if num_chunks <= 1:
        return
    if type(layer.quant_method) is not UnquantizedLinearMethod:
        logger.warning("%s uses %s: only unquantized linear layers are split; left whole",
                       layer.prefix, type(layer.quant_method).__name__)
        return
    layer.quant_method = _split_linear_method_cls()(num_chunks, op_name)


def linear_chunked(layer: torch.nn.Module) -> ChunkedLinear | None:
    return getattr(getattr(layer, "quant_method", None), "chunked", None)


def _make_layer_classes() -> list[type]:
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    def split_on_init(base: type) -> type:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)
            maybe_split_linear(self)

        return type(f"Weaver{base.__name__}", (base,), {"__init__": __init__})

    linears = [split_on_init(base) for base in (ColumnParallelLinear, MergedColumnParallelLinear,
                                                 QKVParallelLinear, RowParallelLinear)]
    return [*linears, _logits_processor_cls(LogitsProcessor)]


def _logits_processor_cls(base: type) -> type:
    class WeaverLogitsProcessor(base):
        """``LogitsProcessor`` whose LM head runs as vocabulary chunks (docs/vllm-hooks.md,
        "Layers":
        the head is applied here, in ``_apply_head``, not in ``ParallelLMHead.forward``)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.weaver_num_chunks = current_split_chunks().get(LM_HEAD_NAME, 1)
            self.weaver_chunked: ChunkedLinear | None = None
            self.weaver_poll: Poll | None = None

        def _apply_head(self, lm_head: Any, hidden_states: torch.Tensor,
                        embedding_bias: torch.Tensor | None) -> torch.Tensor:
            if self.weaver_num_chunks <= 1 or (
                self.head_dtype is not None and self.head_dtype != hidden_states.dtype
            ):
                return super()._apply_head(lm_head, hidden_states, embedding_bias)
            if self.weaver_chunked is None:
                self.weaver_chunked = self._pack_chunks(lm_head)
            self.weaver_chunked.poll = self.weaver_poll
            logits = self.weaver_chunked(hidden_states, use_bias=False)
            return logits if embedding_bias is None else logits + embedding_bias

        def _pack_chunks(self, lm_head: Any) -> ChunkedLinear:
            from vllm.model_executor.layers.vocab_parallel_embedding import (
                UnquantizedEmbeddingMethod,
            )

            if not isinstance(lm_head.quant_method, UnquantizedEmbeddingMethod):
                raise ValueError(
                    f"the split plan splits the LM head, but it uses "
                    f"{type(lm_head.quant_method).__name__}; only an unquantized head can be "
                    "split: set lm_head chunks to 1")
            vocab = lm_head.weight.shape[0]
            if self.weaver_num_chunks > vocab:
                raise ValueError(f"split plan cuts the LM head ({vocab} rows) into "
                                 f"{self.weaver_num_chunks} chunks; lower it to <= {vocab}")
            logger.info("LM head runs as %d vocabulary chunks", self.weaver_num_chunks)
            return ChunkedLinear(lm_head.weight.data, None, self.weaver_num_chunks,
                                 LM_HEAD_NAME)

    return WeaverLogitsProcessor


_registered: dict[str, bool] = {"done": False}


def register_split_layers() -> None:
    """Register the OOT layers (idempotent: vLLM's registry refuses a name twice)."""
    if _registered["done"]:
        return
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    for cls in _make_layer_classes():
        name = cls.__mro__[1].__name__
        if name not in op_registry_oot:
            PluggableLayer.register_oot(cls, name=name)
    _registered["done"] = True


class AttentionChunks(ChunkedOperator):
    """One attention layer's split: ``num_chunks`` groups of sequences (the metadata
    builder cuts them, weaver/vllm_ext/attention/backend.py; a step with fewer sequences
    has fewer groups), the cold worker's poll between them, and the counters."""

    def __init__(self, num_chunks: int) -> None:
        if num_chunks < 2:
            raise ValueError(f"an attention split needs >= 2 chunks, not {num_chunks}")
        super().__init__(num_chunks, ATTN_OP_NAME)


def attention_chunked(layer: torch.nn.Module) -> Any:
    """The ``AttentionChunks`` of a split attention layer (held by Weaver's attention
    impl), else None."""
    return getattr(getattr(layer, "impl", None), "weaver_attn_chunks", None)


def split_modules(model: torch.nn.Module) -> dict[str, ChunkedLinear | Any]:
    """Every split operator of ``model`` by module name: linear layers (their
    ``ChunkedLinear``), attention layers (their ``AttentionChunks``) and split logits
    processors (the processor itself)."""
    found: dict[str, Any] = {}
    for name, module in model.named_modules():
        if linear_chunked(module) is not None:
            found[name] = linear_chunked(module)
        elif attention_chunked(module) is not None:
            found[name] = attention_chunked(module)
        elif getattr(module, "weaver_num_chunks", 1) > 1:
            found[name] = module
    return found


def _is_logits_processor(target: Any) -> bool:
    return hasattr(target, "weaver_num_chunks")


def install_split_polls(model: torch.nn.Module, poll: Poll | None) -> int:
    """Make every split operator call ``poll`` between its chunks; returns how many."""
    modules = split_modules(model)
    for target in modules.values():
        if _is_logits_processor(target):
            target.weaver_poll = poll
        else:  # a ChunkedOperator
            target.poll = poll
    return len(modules)


def split_stats(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Per operator kind: chunks, calls, chunk calls and polls summed over its layers."""
    totals: dict[str, dict[str, int]] = {}
    for target in split_modules(model).values():
        chunked = target.weaver_chunked if _is_logits_processor(target) else target
        if chunked is None:  # LM head not packed yet (no logits computed so far)
            continue
        entry = totals.setdefault(chunked.op_name, {"chunks": 0, "calls": 0, "chunk_calls": 0,
                                                    "polls": 0, "layers": 0})
        for key, value in chunked.stats().items():
            entry[key] = value if key == "chunks" else entry[key] + value
        entry["layers"] += 1
    return totals
