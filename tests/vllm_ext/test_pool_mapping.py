"""A unified pool mapped by an engine that did not create it (attention/pool.py attach_pool)
stays out of the resource tracker that all of a `weaver serve`'s engines share: the creator's
unlink at shutdown then finds its registration there (before, the mapping engine's
unregister dropped it, and the tracker printed a KeyError traceback at every shutdown)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import types
    from multiprocessing import shared_memory
    from weaver.vllm_ext.attention.pool import attach_pool

    name = "weaver-test-pool-mapping-%d" % __import__("os").getpid()
    owner = shared_memory.SharedMemory(name=name, create=True, size=8192)  # the cold engine
    plan = types.SimpleNamespace(pool_name=name, pool_bytes=8192)
    mapped = attach_pool(plan)                                   # a hot engine
    mapped.buf[:4] = b"kv!!"
    assert bytes(owner.buf[:4]) == b"kv!!"
    mapped.close()
    try:
        attach_pool(types.SimpleNamespace(pool_name=name, pool_bytes=16384))
    except ValueError as exc:
        assert "created for another plan" in str(exc), exc
    else:
        raise AssertionError("a pool smaller than its plan was mapped")
    owner.close()
    owner.unlink()                                               # the cold engine's exit
    print("unlinked")
""")


def test_a_mapped_pool_leaves_the_creators_tracker_entry_alone():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "unlinked" in done.stdout
    # The resource tracker writes to the same stderr, and is done once the process exits.
    assert "KeyError" not in done.stderr and "leaked" not in done.stderr, done.stderr


def test_a_missing_pool_says_how_to_start_it():
    from weaver.vllm_ext.attention.pool import attach_pool

    with pytest.raises(ValueError, match="start the engines through weaver serve"):
        attach_pool(type("Plan", (), {"pool_name": "weaver-no-such-pool", "pool_bytes": 1}))
