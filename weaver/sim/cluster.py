"""What every policy builds on: the engine, performance models, KV pools and servers."""

from __future__ import annotations

from collections.abc import Callable

from weaver.sim.config import SimConfig
from weaver.sim.engine import Engine
from weaver.sim.instance import BlockPool, Instance, ModelServer, ServerConfig, SimRequest
from weaver.sim.perf_model import LinkModel, PerfModel
from weaver.sim.profile import (
    CPU_DEVICE,
    DeviceSpec,
    Profile,
    get_device,
    get_shape,
    roofline_profile,
    tensor_parallel_profile,
)


class Cluster:
    def __init__(self, config: SimConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        # None for CPU cores: every model there has a measured profile and KV in blocks.
        self.device: DeviceSpec | None = (None if config.cluster.device == CPU_DEVICE
                                          else get_device(config.cluster.device))
        self.finished: list[SimRequest] = []
        self._perf: dict[tuple[str, int], PerfModel] = {}

    def perf(self, model: str, tp: int = 1) -> PerfModel:
        """The model's step times, sharded over `tp` devices when tp > 1."""
        if (model, tp) not in self._perf:
            profile = self._profile(model) if tp == 1 else tensor_parallel_profile(
                self.perf(model).profile, tp, self.config.server.allreduce_latency_us * 1e-6)
            self._perf[model, tp] = PerfModel(profile)
        return self._perf[model, tp]

    def _profile(self, model: str) -> Profile:
        spec = self.config.model(model)
        if spec.profile:
            return Profile.load(spec.profile)
        assert self.device is not None  # config validation: cpu needs profiles
        return roofline_profile(get_shape(spec.shape), self.device)

    def link(self, model: str) -> LinkModel:
        """The device-to-device link as the model's profile describes it (the roofline
        profiles copy it from the device datasheet; measured ones measure it)."""
        profile = self.perf(model).profile
        return LinkModel(profile.link_bandwidth_bps, profile.link_latency_s)

    def server_config(self, model: str) -> ServerConfig:
        spec, srv = self.config.model(model), self.config.server
        return ServerConfig(spec.block_size or srv.block_size,
                            spec.max_num_seqs or srv.max_num_seqs,
                            srv.max_num_batched_tokens, srv.scheduling)

    def block_bytes(self, model: str) -> int:
        return self.server_config(model).block_size * self.perf(model).shape.kv_bytes_per_token

    def kv_capacity_bytes(self, models: list[str], tp: int = 1) -> float:
        """KV memory of a device (of `tp` devices together): the blocks its models were
        given (as a deployment's engines are), else device memory left after the weights
        of the models on it."""
        if all(self.config.model(m).num_blocks is not None for m in models):
            return float(sum(self.config.model(m).num_blocks * self.block_bytes(m)
                             for m in models))
        assert self.device is not None  # config validation: cpu models give num_blocks
        srv = self.config.server
        weights = sum(self.perf(m).shape.params_bytes for m in models)
        reserve = srv.activation_reserve_gib * (1 << 30) * len(models) * tp
        capacity = tp * self.device.memory_bytes * srv.gpu_memory_utilization - weights \
            - reserve
        if capacity <= 0:
            raise ValueError(f"models {models} do not fit on {tp} {self.device.name}: "
                             f"weights {weights / 2**30:.1f} GiB; place fewer models per GPU")
        return capacity

    def make_server(self, model: str, pool: BlockPool, phase: str = "both",
                    tp: int = 1) -> ModelServer:
        server = ModelServer(model, self.perf(model, tp), pool, self.server_config(model),
                             phase)
        server.on_finished = self.finished.append
        return server

    def make_instance(self, name: str, models: list[str], phase: str = "both",
                      factory: InstanceFactory = Instance, tp: int = 1) -> Instance:
        """One instance on one GPU (on `tp` GPUs, its models sharded over them); its models
        share one KV pool."""
        pool = BlockPool(self.kv_capacity_bytes(models, tp))
        return factory(self.engine, name,
                       [self.make_server(m, pool, phase, tp) for m in models])


InstanceFactory = Callable[[Engine, str, list[ModelServer]], Instance]
