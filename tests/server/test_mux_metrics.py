"""A mux group's turn counters in the gateway's /metrics (weaver/server/mux.py), read from
a real turn table."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from weaver.config.deployment import parse_deployment
from weaver.mux.table import TurnTable
from weaver.mux.turns import Kind
from weaver.server.mux import MuxTurnsCollector, group_layouts, mux_block, remove_turn_tables


def test_counters_of_the_table_are_served_and_the_table_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("WEAVER_RUNTIME_DIR", str(tmp_path))
    models = [{"name": n, "model": "smollm2-135m-instruct"} for n in ("a", "b")]
    deployment = parse_deployment({"models": models, "mux": [{"name": "pair",
                                                              "models": ["a", "b"]}]})
    registry = CollectorRegistry()
    collector = MuxTurnsCollector(deployment)
    registry.register(collector)
    assert b"weaver_mux_steps_total{" not in generate_latest(registry)  # no table yet
    (layout,) = group_layouts(deployment)
    table = TurnTable.open(layout)
    assert table.try_start(1, Kind.PREFILL)
    table.finish(1)
    text = generate_latest(registry).decode()
    assert 'weaver_mux_steps_total{group="pair",kind="prefill",model="b"} 1.0' in text
    assert 'weaver_mux_steps_total{group="pair",kind="decode",model="a"} 0.0' in text
    assert 'weaver_mux_reclaimed_turns_total{group="pair",model="b"} 0.0' in text
    collector.close()
    remove_turn_tables(deployment)
    assert list(tmp_path.iterdir()) == []


def test_each_member_gets_a_block_its_engine_reads_back():
    from weaver.vllm_ext.mux_gate import mux_membership

    models = [{"name": n, "model": "smollm2-135m-instruct"} for n in ("a", "b", "c")]
    deployment = parse_deployment({"models": models, "mux": [
        {"name": "pair", "models": ["a", "b"], "mode": "temporal", "rates": {"a": 3.0}}]})
    block = mux_block(deployment, "b")
    membership = mux_membership({"weaver": {"mux": block}})
    assert membership.member == "b" and membership.layout.group.endswith("-pair")
    assert membership.layout.weights == (3.0, 1.0) and membership.layout.mode.value == "temporal"
    assert mux_block(deployment, "c") is None
