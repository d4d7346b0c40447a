from __future__ import annotations

import os
import uuid

import pytest

from weaver.offload.naming import DEFAULT_SHM_DIR, region_name, region_paths


@pytest.fixture
def shm_name():
    """A region name unique to this test; asserts nothing of ours is left behind."""
    name = region_name(f"wvtest{os.getpid()}", "hot/model", uuid.uuid4().hex[:8])
    yield name
    leftovers = [p for p in region_paths(name, DEFAULT_SHM_DIR) if os.path.exists(p)]
    for path in leftovers:
        os.unlink(path)
    assert not leftovers, f"test left shared-memory entries behind: {leftovers}"
