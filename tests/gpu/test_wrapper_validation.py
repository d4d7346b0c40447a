"""The kernel wrappers reject bad inputs before anything touches a device (CPU/meta)."""

from __future__ import annotations

import pytest
import torch

from weaver.offload.cuda import kernels


def _inputs(device: str = "cpu", **changes: object) -> dict[str, torch.Tensor]:
    t = {
        "q": torch.empty(3, 8, 64, dtype=torch.float16, device=device),
        "kv_layer": torch.empty(10, 2, 16, 128, dtype=torch.float16, device=device),
        "seq_lens": torch.empty(3, dtype=torch.int32, device=device),
        "block_table": torch.empty(3, 4, dtype=torch.int32, device=device),
    }
    t.update(changes)  # type: ignore[arg-type]
    return t


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"q": torch.empty(3, 8, 64, dtype=torch.float64)}, "unsupported"),
        ({"q": torch.empty(3, 512, dtype=torch.float16)}, r"q must be \[num_seqs"),
        ({"kv_layer": torch.empty(10, 2, 16, 64, dtype=torch.float16)}, "2\\*head_size"),
        ({"kv_layer": torch.empty(10, 2, 16, 128, dtype=torch.bfloat16)}, "dtype"),
        (
            {"kv_layer": torch.empty(10, 3, 16, 128, dtype=torch.float16)},
            "multiple of num_kv_heads",
        ),
        ({"kv_layer": torch.empty(10, 2, 24, 128, dtype=torch.float16)}, "multiple of 16"),
        (
            {
                "q": torch.empty(3, 8, 320, dtype=torch.float16),
                "kv_layer": torch.empty(10, 2, 16, 640, dtype=torch.float16),
            },
            "head_size 320",
        ),
        (
            {
                "q": torch.empty(3, 8, 60, dtype=torch.float16),
                "kv_layer": torch.empty(10, 2, 16, 120, dtype=torch.float16),
            },
            "multiple of 8",
        ),
        ({"seq_lens": torch.empty(3, dtype=torch.int64)}, "seq_lens must be int32"),
        ({"seq_lens": torch.empty(4, dtype=torch.int32)}, "seq_lens must be int32"),
        ({"block_table": torch.empty(2, 4, dtype=torch.int32)}, "block_table must be int32"),
        ({"block_table": torch.empty(3, 8, dtype=torch.int32)[:, ::2]}, "contiguous"),
    ],
)
def test_attention_inputs_are_checked(changes: dict[str, torch.Tensor], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kernels.validate_attention_inputs(**_inputs(**changes))


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_well_shaped_non_cuda_tensors_are_refused(device: str) -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        kernels.validate_attention_inputs(**_inputs(device))
    with pytest.raises(ValueError, match="CUDA device"):
        # the library is never touched: validation fails first
        kernels.paged_decode_attention(None, scale=1.0, **_inputs(device))  # type: ignore[arg-type]


def test_out_must_match_q() -> None:
    with pytest.raises(ValueError, match="out must match q"):
        kernels.validate_attention_inputs(
            **_inputs(), out=torch.empty(3, 8, 32, dtype=torch.float16)
        )


def test_transport_kernels_check_their_arguments() -> None:
    region = torch.empty(4096, dtype=torch.uint8)
    desc = torch.empty(20, dtype=torch.int64)
    with pytest.raises(ValueError, match="desc must be on a CUDA device"):
        kernels.publish(None, region, desc, seq=1, layer=0, num_seqs=1, scale=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flat uint8"):
        kernels.publish(None, region.view(torch.int64), desc, seq=1, layer=0, num_seqs=1, scale=1.0)  # type: ignore[arg-type]
    meta_desc = torch.empty(20, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="desc must be on a CUDA device"):
        kernels.wait_done(
            None, region, meta_desc, torch.empty(2, dtype=torch.int32), seq=1, timeout_s=1
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="desc must be int64"):
        kernels.poll_and_attend(
            None,  # type: ignore[arg-type]
            torch.float16,
            region,
            desc.float(),
            torch.empty(4, dtype=torch.int64),
            torch.empty(1, dtype=torch.int32),
            head_size=64,
            num_blocks=1,
        )


def test_kernel_variant_follows_dtype_and_head_size() -> None:
    assert kernels.kernel_name("k", torch.bfloat16, 128) == "k_bf16_h128"
    assert kernels.kernel_name("k", torch.float32, 129) == "k_f32_h256"
    with pytest.raises(ValueError, match="head_size 257"):
        kernels.kernel_name("k", torch.float16, 257)


@pytest.mark.parametrize(
    ("num_seqs", "num_q_heads", "num_kv_heads", "expected"),
    [(16, 32, 8, 128), (1, 8, 8, 8), (3, 14, 2, 12), (2, 8, 1, 4), (5, 4, 4, 20)],
)
def test_one_work_item_per_sequence_kv_head_and_chunk_of_four_query_heads(
    num_seqs: int, num_q_heads: int, num_kv_heads: int, expected: int
) -> None:
    """Llama-3-8B's GQA (4 query heads per KV head) is one item per (sequence, KV head), so
    its K/V are read once; 7 query heads per KV head take two items."""
    assert kernels.attention_items(num_seqs, num_q_heads, num_kv_heads) == expected


def test_the_armed_server_sizes_its_buffers_as_the_kernels_read_them() -> None:
    """kernels.SCRATCH_WORDS and partial_floats are what csrc/ uses (parsed from the source:
    a scratch word past the host's tensor, or a span state longer than its slot, would
    corrupt memory silently)."""
    import re

    from weaver.offload.cuda.jit import csrc_dir

    cold = (csrc_dir() / "offload_cold.cu").read_text()
    assert int(re.search(r"kScratchWords = (\d+)", cold).group(1)) == kernels.SCRATCH_WORDS
    highest = max(int(n) for n in re.findall(r"kScratch(?!Words)\w+ = (\d+),", cold))
    assert highest < kernels.SCRATCH_WORDS
    attention = (csrc_dir() / "paged_attention.cuh").read_text()
    assert "return kMaxGroup * (2 + p.head_size);" in attention
    assert kernels.partial_floats(128) == kernels.MAX_GROUP * 130


@pytest.mark.parametrize(
    "changes",
    [{"num_blocks": 0}, {"span_tokens": 0}, {"queued_pairs": 0}, {"watch_s": 0.0},
     {"refill_s": -1.0}, {"backoff_ns": -1}],
)
def test_armed_server_config_refuses_bad_values(changes: dict) -> None:
    from weaver.offload.cuda.armed_server import ArmedServerConfig

    with pytest.raises(ValueError):
        ArmedServerConfig(**changes)
