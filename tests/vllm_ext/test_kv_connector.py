"""Weaver's KV connector (weaver/vllm_ext/kv_connector.py) and its staging segments
(weaver/kv/staging.py), below the engine: block copies through a real segment, and the
scheduler side's plan of which blocks each step stages or loads, driven with vLLM's own
scheduler-output classes. The connector inside real engines, token-exact:
tests/server/test_phase_split_e2e.py."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import CachedRequestData

from weaver.kv.staging import (
    W_CACHED_TOKENS,
    W_PROMPT_TOKENS,
    W_SAVED_TOKENS,
    StagingSegment,
    load_blocks,
    prompt_hash,
    read_report,
    remove_segment,
    save_blocks,
)
from weaver.vllm_ext.kv_connector import (
    LOAD_KEY,
    SAVE_KEY,
    BlockCopy,
    StagingMetadata,
    WeaverStagingConnector,
    kv_transfer_config,
)

BLOCK = 4  # tokens per block


@pytest.fixture
def segment_name():
    name = f"wvkvtest_{uuid.uuid4().hex[:12]}"
    yield name
    remove_segment(name)


def connector(role: str = "kv_both") -> WeaverStagingConnector:
    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv_transfer_config(role)),
                             cache_config=SimpleNamespace(block_size=BLOCK))
    return WeaverStagingConnector(config, KVConnectorRole.SCHEDULER, None)


def request(req_id: str, prompt: list[int], params: dict) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt,
                           kv_transfer_params=params)


def new_req(req_id: str, prompt: list[int], block_ids: list[int], computed: int):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(block_ids,),
                           num_computed_tokens=computed)


def output(new=(), cached=None, scheduled=None) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=list(new),
                           scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
                           num_scheduled_tokens=scheduled or {})


def cached(req_id: str, new_block_ids: list[int] | None, computed: int,
           resumed: bool = False) -> CachedRequestData:
    data = CachedRequestData.make_empty()
    data.req_ids = [req_id]
    data.new_block_ids = [(new_block_ids,) if new_block_ids is not None else None]
    data.num_computed_tokens = [computed]
    data.resumed_req_ids = {req_id} if resumed else set()
    return data


def test_blocks_round_trip_through_a_segment_in_any_block_layout(segment_name):
    # vLLM's per-layer views keep blocks at dim 0; what follows is the backend's business.
    source = torch.randn(8, 3, BLOCK, 16)
    staged = StagingSegment.create(segment_name, 2, 3, source[0].numel() * 4, BLOCK, 10, 1)
    save_blocks(staged, 1, source, [5, 2], first_block=0)
    save_blocks(staged, 1, source, [7], first_block=2)
    target = torch.zeros(8, 3, BLOCK, 16)
    load_blocks(StagingSegment.open(segment_name), 1, target, [0, 1, 3], first_block=0)
    assert torch.equal(target[[0, 1, 3]], source[[5, 2, 7]])
    assert target[[2, 4, 5, 6, 7]].abs().sum() == 0
    staged.close()


def test_a_chunked_prefill_stages_each_steps_blocks_and_rewrites_a_partial_one():
    producer = connector("kv_producer")
    prompt = list(range(10))  # blocks of 4: [0-3] [4-7] [8-9]
    assert producer.get_num_new_matched_tokens(
        request("r", prompt, {SAVE_KEY: "seg"}), 0) == (0, False)
    first = producer.build_connector_meta(output([new_req("r", prompt, [11, 12], 0)],
                                                 scheduled={"r": 6}))
    save, = first.saves
    assert (save.block_ids, save.first_block, save.num_tokens) == ([11, 12], 0, 6)
    assert (save.num_blocks, save.prompt_tokens) == (3, 10)
    assert save.prompt_digest == prompt_hash(prompt)
    second = producer.build_connector_meta(output(cached=cached("r", [13], 6),
                                                  scheduled={"r": 4}))
    save, = second.saves
    assert (save.block_ids, save.first_block, save.num_tokens) == ([12, 13], 1, 10)
    decode_step = producer.build_connector_meta(output(cached=cached("r", None, 10),
                                                       scheduled={"r": 1}))
    assert decode_step.saves == []  # output tokens are not staged


def test_a_prefix_cache_hit_is_staged_with_the_first_step_and_a_preempted_one_again():
    producer = connector("kv_producer")
    prompt = list(range(9))
    producer.get_num_new_matched_tokens(request("r", prompt, {SAVE_KEY: "seg"}), 4)
    meta = producer.build_connector_meta(output([new_req("r", prompt, [3, 4], 4)],
                                                scheduled={"r": 3}))
    assert meta.saves[0].block_ids == [3, 4] and meta.saves[0].first_block == 0
    again = producer.build_connector_meta(output(cached=cached("r", [7, 8, 9], 0,
                                                               resumed=True),
                                                 scheduled={"r": 9}))
    assert again.saves[0].block_ids == [7, 8, 9] and again.saves[0].first_block == 0


def test_the_token_engine_loads_all_but_the_last_prompt_token(segment_name):
    consumer = connector("kv_consumer")
    prompt = list(range(10))
    staged = StagingSegment.create(segment_name, 1, 3, 64, BLOCK, 10, prompt_hash(prompt))
    staged.write(W_SAVED_TOKENS, 10)
    req = request("r", prompt, {LOAD_KEY: segment_name})
    assert consumer.get_num_new_matched_tokens(req, 4) == (5, False)  # 4 cached locally
    assert staged.read(W_CACHED_TOKENS) == 4
    blocks = SimpleNamespace(get_block_ids=lambda: ([20, 21, 22],))
    consumer.update_state_after_alloc(req, blocks, 5)
    meta = consumer.build_connector_meta(output())
    load, = meta.loads
    assert (load.block_ids, load.first_block, load.num_tokens) == ([21, 22], 1, 9)
    assert consumer.build_connector_meta(output()).loads == []  # once
    staged.close()


@pytest.mark.parametrize("problem", ["missing", "other prompt", "not staged whole"])
def test_kv_that_cannot_be_used_is_computed_instead(segment_name, problem):
    consumer = connector("kv_consumer")
    prompt = list(range(10))
    if problem != "missing":
        digest = prompt_hash(prompt if problem != "other prompt" else prompt[::-1])
        staged = StagingSegment.create(segment_name, 1, 3, 64, BLOCK, 10, digest)
        staged.write(W_SAVED_TOKENS, 10 if problem != "not staged whole" else 4)
        staged.close()
    req = request("r", prompt, {LOAD_KEY: segment_name})
    assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)


def test_the_report_says_what_moved(segment_name):
    staged = StagingSegment.create(segment_name, 30, 2, 1000, 32, 40, 5)
    staged.write(W_SAVED_TOKENS, 40)
    staged.close()
    report = read_report(segment_name)
    assert report is not None and report.prompt_tokens == 40
    assert report.bytes_staged == 2 * 30 * 1000 and report.num_loads == 0
    assert report.is_recomputed  # neither loaded nor cached by the token engine
    assert StagingSegment.open(segment_name).read(W_PROMPT_TOKENS) == 40
    assert read_report("wvkvtest_none") is None
    assert isinstance(StagingMetadata(), StagingMetadata)


def test_a_prompt_the_token_engine_had_cached_is_not_counted_as_recomputed(segment_name):
    consumer = connector("kv_consumer")
    prompt = list(range(9))  # all but the last token: two whole blocks, cached locally
    staged = StagingSegment.create(segment_name, 1, 3, 64, BLOCK, 9, prompt_hash(prompt))
    staged.write(W_SAVED_TOKENS, 9)
    staged.close()
    req = request("r", prompt, {LOAD_KEY: segment_name})
    assert consumer.get_num_new_matched_tokens(req, 8) == (0, False)
    report = read_report(segment_name)
    assert report.cached_tokens == 8 and not report.is_recomputed


def test_a_segment_gone_before_the_load_reports_its_blocks_as_failed():
    worker = connector("kv_consumer")
    worker.register_kv_caches({"layer.0": torch.zeros(4, 2, BLOCK, 8)})
    worker.bind_connector_metadata(StagingMetadata(loads=[BlockCopy(
        "r", "wvkvtest_gone", [1, 2], 0, 7)]))
    context = SimpleNamespace(no_compile_layers={})
    worker.start_load_kv(context)  # logs, does not raise into the forward pass
    assert worker.get_block_ids_with_load_errors() == {1, 2}
    assert worker.get_block_ids_with_load_errors() == set()
