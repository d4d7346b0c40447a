"""The rendezvous of a weaving pair (weaver/weaving/rendezvous.py, weaver/weaving/pair_link.py;
both launchers link pairs this way), in one process: real shared-memory regions, the hot
side's attach and counters given as callables (in an engine: the worker's collective_rpc)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from weaver.offload.layout import HotAttentionShape
from weaver.offload.naming import region_paths
from weaver.weaving import rendezvous
from weaver.weaving.cold import ColdWeaving
from weaver.weaving.pair_link import ColdLink, HotLink
from weaver.weaving.plan import plugin_hot_plan, region_bytes_of
from weaver.weaving.rendezvous import PairFiles
from weaver.weaving.series import WAIT_BUCKETS

SHAPE = HotAttentionShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=32,
                          block_size=16, dtype="float32", kv_format="pages")
MiB = 1 << 20


@pytest.fixture
def files(tmp_path) -> PairFiles:
    return PairFiles(tmp_path / "runtime")


def plan_of(remote_mib: float, hot: str = "hot"):
    return plugin_hot_plan(hot, "p1", SHAPE, remote_mib * MiB / 2**30, max_model_len=128,
                           max_num_seqs=4, policy={"offload_ratio": 1.0, "timeout_s": 1.0},
                           transport="shm")


class Attacher:
    """Stands in for the hot worker's weaver_attach_hot (reached by collective_rpc)."""

    def __init__(self) -> None:
        self.regions: list[str] = []

    def __call__(self, plan_data: dict, cuda_handle: str | None) -> None:
        assert cuda_handle is None  # shared memory: found by name
        assert all(os.path.exists(p) for p in region_paths(plan_data["region_name"]))
        self.regions.append(plan_data["region_name"])


@pytest.fixture
def cold(files):
    weaving = ColdWeaving.open([], make_executor=lambda plan: object())
    link = ColdLink(files, ["p1"], lend_bytes=4 * MiB, cold_model="cold", cold=weaving,
                    make_executor=lambda plan: object())
    yield link
    link.close()
    weaving.close()


def test_a_pair_name_is_checked():
    with pytest.raises(ValueError, match="weaving pair name 'a/b'"):
        rendezvous.check_pair_name("a/b")


def test_a_file_whose_writer_died_reads_as_absent(files):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(done.stdout)
    files.publish("p1", "cold", {"status": "ready"})
    assert files.read("p1", "cold")["status"] == "ready"
    path = files.root / "p1.cold.json"
    path.write_text(json.dumps({"status": "ready", "pid": dead_pid}))
    assert files.read("p1", "cold") is None
    assert files.read_even_if_dead("p1", "cold")["pid"] == dead_pid


def test_hot_first_then_cold_connects_once(cold, files):
    attach = Attacher()
    hot = HotLink(files, "p1", plan_of(1), attach, read_stats=lambda: {"hot": {}})
    hot.tick(now=0.0)
    assert not hot.connected and attach.regions == []  # no cold side yet
    cold.start()
    cold.step("p1")
    answer = files.read("p1", "cold")
    assert answer["status"] == "ready" and answer["model"] == "cold"
    hot.tick(now=1.0)
    hot.tick(now=2.0)
    assert hot.connected and attach.regions == [answer["region_name"]]
    stats = files.read("p1", "hot.stats")
    assert stats["connected"] is True and stats["attaches"] == 1


def test_cold_first_then_hot_connects(cold, files):
    cold.start()
    cold.step("p1")  # nothing to serve yet
    assert files.read("p1", "cold")["status"] == "waiting"
    attach = Attacher()
    hot = HotLink(files, "p1", plan_of(1), attach, read_stats=lambda: {"hot": {}})
    cold.step("p1")
    hot.tick(now=0.0)
    assert hot.connected and len(attach.regions) == 1


def test_a_plan_over_the_lent_memory_is_refused_and_the_hot_side_stays_local(cold, files):
    plan = plan_of(8)  # the cold side lends 4 MiB
    assert region_bytes_of(plan.shape, plan.num_remote_blocks) > 4 * MiB
    attach = Attacher()
    hot = HotLink(files, "p1", plan, attach, read_stats=lambda: {"hot": {}})
    cold.start()
    cold.step("p1")
    answer = files.read("p1", "cold")
    assert answer["status"] == "refused" and "lower its remote_kv_gib" in answer["reason"]
    hot.tick(now=0.0)
    assert not hot.connected and attach.regions == []


def test_a_restarted_cold_side_is_attached_again(cold, files):
    attach = Attacher()
    hot = HotLink(files, "p1", plan_of(1), attach, read_stats=lambda: {"hot": {}})
    cold.start()
    cold.step("p1")
    hot.tick(now=0.0)
    first = attach.regions[-1]
    # What a restarted cold engine does: a new region for the same plan, a new answer.
    cold.served.clear()
    cold.step("p1")
    hot.tick(now=1.0)
    assert attach.regions == [first, files.read("p1", "cold")["region_name"]]
    assert hot.connected and hot.num_attaches == 2


def test_what_the_hot_side_keeps_of_a_restarted_cold_side_is_let_go_before_the_reattach(
        cold, files):
    events: list[str] = []
    attach = Attacher()

    def attaching(plan_data: dict, handle: str | None) -> None:
        events.append("attach")
        attach(plan_data, handle)

    hot = HotLink(files, "p1", plan_of(1), attaching, read_stats=lambda: {"hot": {}},
                  before_reattach=lambda: events.append("let go"))
    cold.start()
    cold.step("p1")
    hot.tick(now=0.0)
    assert events == ["attach"]  # the first attach has nothing to let go
    cold.served.clear()  # the cold engine restarted: a new region
    cold.step("p1")
    hot.tick(now=1.0)
    hot.tick(now=2.0)  # the same region again: nothing to do
    assert events == ["attach", "let go", "attach"] and hot.connected


def test_a_changed_hot_plan_gets_a_new_region_and_the_old_one_is_unlinked(cold, files):
    cold.start()
    HotLink(files, "p1", plan_of(1), Attacher(), read_stats=lambda: {"hot": {}})
    cold.step("p1")
    old = cold.served["p1"].region_name
    HotLink(files, "p1", plan_of(2), Attacher(), read_stats=lambda: {"hot": {}})  # restarted
    cold.step("p1")
    new = cold.served["p1"]
    assert new.region_name != old and replace(new, region_name="") == plan_of(2)
    assert not any(os.path.exists(p) for p in region_paths(old))
    assert list(cold.cold.receivers) == [new.region_name]


def test_a_dead_cold_side_disconnects_the_hot_side(cold, files):
    attach = Attacher()
    hot = HotLink(files, "p1", plan_of(1), attach, read_stats=lambda: {"hot": {}})
    cold.start()
    cold.step("p1")
    hot.tick(now=0.0)
    assert hot.connected
    answer = json.loads((files.root / "p1.cold.json").read_text())
    (files.root / "p1.cold.json").write_text(json.dumps({**answer, "pid": 2**22 + 1}))
    hot.tick(now=1.0)
    assert not hot.connected
    # Killed, the cold engine could not unlink its region: the hot side removes the names.
    assert not any(os.path.exists(p) for p in region_paths(answer["region_name"]))


def test_a_failed_attach_is_retried_later(cold, files):
    calls = []

    def failing(plan_data, handle):
        calls.append(plan_data["region_name"])
        raise RuntimeError("worker busy")

    hot = HotLink(files, "p1", plan_of(1), failing, read_stats=lambda: {"hot": {}})
    cold.start()
    cold.step("p1")
    hot.tick(now=0.0)
    hot.tick(now=1.0)  # within the retry back-off: not tried again
    assert not hot.connected and len(calls) == 1 and hot.num_attach_failures == 1
    hot.tick(now=10.0)
    assert len(calls) == 2


def test_closing_withdraws_only_this_process_files(cold, files):
    cold.start()
    hot = HotLink(files, "p1", plan_of(1), Attacher(), read_stats=lambda: {"hot": {}})
    hot.close()
    cold.close()
    assert files.read("p1", "hot") is None and files.read("p1", "cold") is None


def test_the_offload_waits_are_published_as_a_histogram(cold, files):
    waits = [[1e-4, 3e-3], [10.0]]  # two drains of the worker's waits
    hot = HotLink(files, "p1", plan_of(1), Attacher(),
                  read_stats=lambda: {"hot": {"wait_seconds": waits.pop(0)}})
    hot.publish_stats()
    hot.publish_stats()
    stats = files.read("p1", "hot.stats")
    counts = stats["wait_counts"]
    assert sum(counts) == 3 and counts[-1] == 1  # 10 s is past the last bucket
    assert counts[WAIT_BUCKETS.index(1e-4)] == 1 and counts[WAIT_BUCKETS.index(3e-3)] == 1
    assert stats["wait_sum_s"] == pytest.approx(10.0031)
    assert "wait_seconds" not in stats
