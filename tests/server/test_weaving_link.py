"""The gateway's part in linking a weaving pair (weaver/server/weaving.py): it waits until
the hot side attached the region the cold side made, making the idle hot engine step, and
/health follows the pair's files. The two sides are the real links (weaver/weaving/
pair_link.py) over real shared-memory regions, in this process; the engines around them are
stand-ins (no vLLM: the engine e2e tests link real ones)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import pytest
from prometheus_client import CollectorRegistry

from weaver.config.deployment import parse_deployment
from weaver.server.weaving import Weaving
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.pair_link import ColdLink, HotLink
from weaver.weaving.plan import GiB, plan_pairs

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}
LEND_GIB = 0.02  # 14 blocks of 32 tokens: one 256-token sequence and some


class HotEngine:
    """A hot engine as the gateway sees it: a step ticks its scheduler's HotLink."""

    def __init__(self, link: HotLink) -> None:
        self.link, self.is_dead, self.steps = link, False, 0

    @property
    def handle(self) -> HotEngine:
        return self

    async def step_once(self) -> None:
        self.steps += 1
        self.link.tick()


class ColdEngine:
    is_dead = False


@pytest.fixture
def weaving(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(SMOLLM2))
    small = {"model": "smollm2", "block_size": 32, "max_model_len": 256}
    deployment = parse_deployment({
        "models": [{"name": "hot", "role": "hot", **small},
                   {"name": "cold", "role": "cold", "lend_kv_gib": LEND_GIB, **small}],
        "weaving": [{"hot": "hot", "cold": ["cold"], "offload_ratio": 1.0}]})
    dirs = {"hot": tmp_path / "m", "cold": tmp_path / "m"}
    feature = Weaving(deployment, plan_pairs(deployment, dirs, "t"), tmp_path / "pairs")
    cold = ColdWeaving.open([], make_executor=lambda plan: object())
    link = ColdLink(feature.files, feature.names, int(LEND_GIB * GiB), "cold", cold,
                    make_executor=lambda plan: object())
    link.start()
    yield feature, link
    link.close()
    cold.close()


def hot_engine(weaving: Weaving, attach) -> HotEngine:
    (plan,) = weaving.plans
    link = HotLink(weaving.files, weaving.names[0], plan, attach,
                   read_stats=lambda: {"hot": {}})
    return HotEngine(link)


def test_start_up_waits_for_the_link_then_health_says_ok(weaving):
    feature, _ = weaving
    attached = []
    hot = hot_engine(feature, lambda plan_data, handle: attached.append(plan_data))

    async def serve() -> dict:
        async with contextlib.AsyncExitStack() as stack:
            feature.set_up(stack, CollectorRegistry())
            await feature.after_start({"hot": hot, "cold": ColdEngine()}, stack)
            return feature.health()

    (pair,) = asyncio.run(serve())["weaving"]
    assert hot.steps >= 1 and len(attached) == 1  # the idle hot engine was made to step
    assert (pair["status"], pair["reason"], pair["offload_ratio"]) == ("ok", None, 1.0)
    assert not feature.files.root.exists()  # the pairs' directory went with the server


def test_a_failed_attach_fails_start_up_saying_why(weaving):
    feature, _ = weaving

    def failing(plan_data, handle):
        raise RuntimeError("the worker has no Weaver attention")

    hot = hot_engine(feature, failing)
    with pytest.raises(RuntimeError, match="could not attach.*no Weaver attention"):
        asyncio.run(feature.after_start({"hot": hot, "cold": ColdEngine()},
                                        contextlib.AsyncExitStack()))


def test_health_says_degraded_while_the_cold_side_is_gone(weaving):
    feature, cold_link = weaving
    hot = hot_engine(feature, lambda plan_data, handle: None)
    cold = ColdEngine()
    asyncio.run(feature.after_start({"hot": hot, "cold": cold}, contextlib.AsyncExitStack()))
    cold.is_dead = True
    (pair,) = feature.health()["weaving"]
    assert (pair["status"], pair["reason"]) == ("degraded", "cold engine is down")
    # Back with a new region the hot side has not attached yet (it links at its next step).
    cold.is_dead = False
    cold_link.served.clear()
    cold_link.step(feature.names[0])
    (pair,) = feature.health()["weaving"]
    assert pair["status"] == "degraded" and "not attached" in pair["reason"]
    asyncio.run(feature.relink("cold"))
    assert feature.health()["weaving"][0]["status"] == "ok"
    assert os.path.isdir(feature.files.root)
