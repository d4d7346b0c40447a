from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import time

import pytest

from weaver.offload.layout import (
    OWNER_PID_OFFSET,
    REGION_MAGIC,
    HotAttentionShape,
    RegionLayout,
)
from weaver.offload.shm_transport import (
    DEFAULT_SHM_DIR,
    ShmRegion,
    is_process_alive,
    region_paths,
)

SHAPE = HotAttentionShape(
    num_layers=2, num_q_heads=4, num_kv_heads=2, head_size=32, block_size=32, dtype="float32"
)
LAYOUT = RegionLayout(SHAPE, num_remote_blocks=8, max_seqs_per_task=4, max_blocks_per_seq=4)


def test_create_attach_share_bytes_and_owner_cleans_up(shm_name):
    owner = ShmRegion.create(LAYOUT, shm_name)
    assert all(os.path.exists(p) for p in region_paths(shm_name))
    assert os.path.getsize(owner.path) == LAYOUT.total_bytes
    hot = ShmRegion.attach(LAYOUT, shm_name)
    hot.buffer[LAYOUT.kv_offset] = 42
    assert owner.buffer[LAYOUT.kv_offset] == 42
    assert bytes(hot.buffer[: len(REGION_MAGIC)]) == REGION_MAGIC
    hot.close()
    hot.close()  # safe twice
    assert all(os.path.exists(p) for p in region_paths(shm_name)), "attacher must not unlink"
    owner.close()
    owner.close()
    assert not any(os.path.exists(p) for p in region_paths(shm_name))
    with pytest.raises(ValueError, match="is closed"):
        _ = owner.buffer


def test_attach_with_other_shape_names_the_mismatch(shm_name):
    with ShmRegion.create(LAYOUT, shm_name):
        other = RegionLayout(
            HotAttentionShape(2, 8, 2, 32, 32, "float32"),
            num_remote_blocks=8,
            max_seqs_per_task=4,
            max_blocks_per_seq=4,
        )
        with pytest.raises(ValueError, match="num_q_heads: region has 4, this side expects 8"):
            ShmRegion.attach(other, shm_name)
        same_size = RegionLayout(
            HotAttentionShape(2, 4, 2, 32, 32, "float32"),
            num_remote_blocks=8,
            max_seqs_per_task=4,
            max_blocks_per_seq=5,  # block table grows inside the metadata padding
        )
        if same_size.total_bytes == LAYOUT.total_bytes:
            with pytest.raises(ValueError, match="max_blocks_per_seq"):
                ShmRegion.attach(same_size, shm_name)


def test_attach_missing_region_is_a_clear_error(shm_name):
    start = time.monotonic()
    with pytest.raises(ValueError, match="start the cold side first"):
        ShmRegion.attach(LAYOUT, shm_name, wait_s=0.1)
    assert time.monotonic() - start < 5


def test_attach_waits_for_a_late_owner(shm_name):
    owners: list[ShmRegion] = []
    timer = threading.Timer(0.2, lambda: owners.append(ShmRegion.create(LAYOUT, shm_name)))
    timer.start()
    try:
        hot = ShmRegion.attach(LAYOUT, shm_name, wait_s=10)
        hot.close()
    finally:
        timer.join()
        for region in owners:
            region.close()


def test_live_owner_is_refused_and_dead_owner_is_reclaimed(shm_name):
    first = ShmRegion.create(LAYOUT, shm_name)
    with pytest.raises(ValueError, match="owned by live process"):
        ShmRegion.create(LAYOUT, shm_name)
    # Pretend the owner died without cleaning up: point the header at a reaped pid.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    struct.pack_into("<q", first.buffer, OWNER_PID_OFFSET, child.pid)
    second = ShmRegion.create(LAYOUT, shm_name)
    assert os.path.exists(second.path)
    first._is_owner = False  # its names now belong to `second`
    first.close()
    second.close()


def test_bad_names_and_dirs_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="invalid shared-memory region name"):
        ShmRegion.create(LAYOUT, "../etc/passwd")
    with pytest.raises(ValueError, match="does not exist"):
        ShmRegion.create(LAYOUT, "ok-name", shm_dir=str(tmp_path / "missing"))


def test_fifo_wakeup_sleeps_until_notified(shm_name):
    with ShmRegion.create(LAYOUT, shm_name) as owner:
        hot = ShmRegion.attach(LAYOUT, shm_name)
        assert not owner.task_wakeup.wait(0.01)
        for _ in range(3):
            hot.task_wakeup.notify()  # several notifications coalesce into one wakeup
        assert owner.task_wakeup.wait(1.0)
        assert not owner.task_wakeup.wait(0.01)
        timer = threading.Timer(0.05, hot.task_wakeup.notify)
        timer.start()
        start = time.monotonic()
        assert owner.task_wakeup.wait(5.0)
        assert time.monotonic() - start < 4.0
        timer.join()
        hot.close()


def test_is_process_alive():
    assert is_process_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not is_process_alive(child.pid)
    assert not is_process_alive(0)


def test_dev_shm_default():
    assert DEFAULT_SHM_DIR == "/dev/shm" and os.path.isdir(DEFAULT_SHM_DIR)


def test_attacher_process_exit_leaves_region_in_place(shm_name):
    # The resource_tracker trap: an attaching process must never unlink at exit.
    with ShmRegion.create(LAYOUT, shm_name) as owner:
        code = (
            "import sys\n"
            "from weaver.offload.layout import HotAttentionShape, RegionLayout\n"
            "from weaver.offload.shm_transport import ShmRegion\n"
            "shape = HotAttentionShape(2, 4, 2, 32, 32, 'float32')\n"
            "layout = RegionLayout(shape, 8, 4, 4)\n"
            f"region = ShmRegion.attach(layout, {shm_name!r})\n"
            "assert 'torch' not in sys.modules\n"  # attaching alone stays light
            "region.buffer[0:0]\n"  # exit without close()
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        assert all(os.path.exists(p) for p in region_paths(shm_name))
        assert bytes(owner.buffer[: len(REGION_MAGIC)]) == REGION_MAGIC
