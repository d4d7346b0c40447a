"""Drift tests: the enums and indices in csrc/*.cuh agree with the Python side."""

from __future__ import annotations

import re

import pytest

from weaver.offload import layout as L
from weaver.offload.cuda import jit
from weaver.offload.cuda.region_desc import (
    DESC_FIELDS,
    check_kernel_shape,
    region_descriptor,
)
from weaver.offload.protocol import WaitStatus


def _enum_values(header: str, enum_name: str) -> dict[str, int]:
    text = (jit.csrc_dir() / header).read_text()
    match = re.search(r"enum\s+" + enum_name + r"\b[^{]*\{(.*?)\};", text, re.S)
    assert match, f"enum {enum_name} not found in {header}"
    body = re.sub(r"//[^\n]*", "", match.group(1))
    values: dict[str, int] = {}
    for entry in filter(None, (e.strip() for e in body.split(","))):
        name, value = (part.strip() for part in entry.split("="))
        values[name] = int(value)
    return values


def _layout(**overrides: object) -> L.RegionLayout:
    shape = dict(num_layers=3, num_q_heads=8, num_kv_heads=2, head_size=64, block_size=16)
    shape.update(overrides)
    hot = L.HotAttentionShape(dtype="bfloat16", **shape)  # type: ignore[arg-type]
    return L.RegionLayout(hot, num_remote_blocks=40, max_seqs_per_task=5, max_blocks_per_seq=7)


def test_descriptor_indices_match_the_header() -> None:
    values = _enum_values("offload_region.cuh", "DescIndex")
    assert values.pop("kDescNumWords") == len(DESC_FIELDS)
    assert sorted(values.values()) == list(range(len(DESC_FIELDS)))
    # kDescTaskSeq -> task_seq, kDescKvLayerBytes -> kv_layer_bytes, ...
    by_index = {
        v: re.sub(r"(?<!^)([A-Z])", r"_\1", k.removeprefix("kDesc")).lower()
        for k, v in values.items()
    }
    assert [by_index[i] for i in range(len(DESC_FIELDS))] == list(DESC_FIELDS)


def test_meta_result_status_and_wait_enums_match() -> None:
    meta_ints = _enum_values("offload_region.cuh", "MetaInt")
    assert meta_ints == {
        "kMetaTaskSeq": L.META_TASK_SEQ,
        "kMetaLayer": L.META_LAYER,
        "kMetaNumSeqs": L.META_NUM_SEQS,
        "kMetaSlidingWindow": L.META_SLIDING_WINDOW,
    }
    assert _enum_values("offload_region.cuh", "MetaFloat") == {
        "kMetaScale": L.META_SCALE,
        "kMetaSoftcap": L.META_SOFTCAP,
    }
    waits = _enum_values("offload_region.cuh", "WaitStatus")
    # DEAD (a pid check) is the host's own: no device wait writes it.
    assert {k.removeprefix("kWait"): v for k, v in waits.items()} == {
        "Pending": WaitStatus.PENDING,
        "Ok": WaitStatus.OK,
        "Failed": WaitStatus.FAILED,
        "Timeout": WaitStatus.TIMEOUT,
        "Closed": WaitStatus.CLOSED,
        "ProtocolError": WaitStatus.PROTOCOL_ERROR,
    }
    text = (jit.csrc_dir() / "offload_region.cuh").read_text()
    assert f"kResultOk = {L.TaskResult.OK}, kResultFailed = {L.TaskResult.FAILED}" in text
    assert f"kStatusClosing = {L.RegionStatus.CLOSING}" in text
    assert f"kStatusClosed = {L.RegionStatus.CLOSED}" in text


def test_descriptor_values_follow_the_layout() -> None:
    layout = _layout()
    desc = dict(zip(DESC_FIELDS, region_descriptor(layout), strict=True))
    assert desc["task_seq"] == L.TASK_SEQ_OFFSET and desc["done_seq"] == L.DONE_SEQ_OFFSET
    assert desc["q"] == layout.q_offset and desc["out"] == layout.out_offset
    assert desc["kv"] + 2 * desc["kv_layer_bytes"] == layout.kv_layer_offset(2)
    assert desc["kv_layer_bytes"] >= 40 * 2 * 16 * 128 * 2
    assert (desc["max_seqs"], desc["max_blocks"], desc["num_blocks"]) == (5, 7, 40)
    # every section the kernels index is 8-byte aligned, so int64/float views are legal
    assert all(desc[name] % 64 == 0 for name in ("meta_ints", "seq_lens", "block_table", "q", "kv"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"head_size": 512}, "head_size 512"),
        ({"head_size": 60}, "multiple of 8"),
        ({"block_size": 24}, "multiple of 16"),
    ],
)
def test_kernel_shape_limits_are_explained(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_kernel_shape(_layout(**overrides))


def test_every_kernel_the_wrappers_launch_is_defined() -> None:
    import torch

    from weaver.offload.cuda import kernels

    sources = {
        name: (jit.csrc_dir() / name).read_text()
        for name in (kernels.ATTENTION_FILE, kernels.HOT_FILE, kernels.COLD_FILE)
    }
    for dtype in kernels.DTYPE_SUFFIX:
        for head_size in (64, 256):
            for base, file_name in (
                ("weaver_paged_attention", kernels.ATTENTION_FILE),
                ("weaver_poll_and_attend", kernels.COLD_FILE),
            ):
                name = kernels.kernel_name(base, dtype, head_size)
                assert re.search(rf"\b{name}\b", sources[file_name]), name
    for name in ("weaver_publish", "weaver_wait_done"):
        assert f'extern "C" __global__ void {name}(' in sources[kernels.HOT_FILE]
    assert torch.float64 not in kernels.DTYPE_SUFFIX
