"""Simulation / planning configs: YAML validated by pydantic, with messages that say how
to fix a bad file. Every field has a default except the models and the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from weaver.mux.turns import DEFAULT_SKIP_LIMIT
from weaver.sim.perf_model import IDLE_POLL_INTERVAL_S
from weaver.sim.profile import CPU_DEVICE, KNOWN_DEVICES, KNOWN_SHAPES
from weaver.workloads.popularity import power_law_rates

POLICY_NAMES = ("dedicated", "mux_temporal", "muxserve", "splitwise", "weaver")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkloadConfig(_Strict):
    """Where request lengths and arrivals come from: `weaver.workloads`, as in `weaver
    bench` (the fields mean what the bench CLI's flags of the same name mean)."""

    trace: str = Field("azure-conv", description="azure-conv | azure-code | burstgpt:PATH")
    filter_name: str | None = Field(None, description="row filter; default: the paper's "
                                    "filter for the trace (weaver.workloads.filters)")
    arrival: Literal["poisson", "gamma", "trace"] = "poisson"
    burstiness: float = Field(1.0, gt=0, description="gamma arrivals' shape (1 = Poisson)")
    length_scale: float = Field(1.0, gt=0, description="multiplies input and output lengths")
    max_model_len: int | None = Field(None, ge=2, description="lengths shrink to fit this")
    traces_dir: str | None = Field(None, description="default: $WEAVER_TRACES_DIR, else the "
                                   "traces shipped with Weaver")


class ModelSpec(_Strict):
    name: str
    shape: str = "llama-3-8b"
    rate: float = Field(ge=0, description="requests per second")
    profile: str | None = Field(None, description="profile JSON; default: roofline")
    num_blocks: int | None = Field(None, gt=0, description="KV capacity in blocks of "
                                   "block_size tokens (as a deployment's engine has); "
                                   "default: device memory left after the weights")
    block_size: int | None = Field(None, gt=0, description="default: server.block_size")
    max_num_seqs: int | None = Field(None, gt=0, description="default: server.max_num_seqs")
    serve: str | None = Field(None, description="what a deployment written from a plan "
                              "serves for this model: a prepared model name or a Hugging "
                              "Face id (`weaver plan --deployments`)")

    @model_validator(mode="after")
    def _known_shape(self) -> ModelSpec:
        if self.profile is None and self.shape not in KNOWN_SHAPES:
            raise ValueError(f"model {self.name!r}: unknown shape {self.shape!r}; use one of "
                             f"{sorted(KNOWN_SHAPES)} or give a profile JSON")
        return self


class ModelSetSpec(_Strict):
    """Many models of one shape whose rates follow a power law (MuxServe §5.1)."""

    num_models: int = Field(gt=0)
    total_rate: float = Field(gt=0)
    alpha: float = Field(1.0, ge=0)
    shape: str = "llama-3-8b"
    serve: str | None = Field(None, description="what every model of the set serves in a "
                              "deployment written from a plan (a platform's fine-tunes of one "
                              "base model: one weights id, an API name per model)")

    def expand(self) -> list[ModelSpec]:
        rates = power_law_rates(self.num_models, self.total_rate, self.alpha)
        return [ModelSpec(name=f"m{i:02d}", shape=self.shape, rate=r, serve=self.serve)
                for i, r in enumerate(rates)]


class ClusterSpec(_Strict):
    device: str = "A100-80GB"
    num_gpus: int = Field(gt=0)

    @model_validator(mode="after")
    def _known_device(self) -> ClusterSpec:
        if self.device != CPU_DEVICE and self.device not in KNOWN_DEVICES:
            raise ValueError(f"unknown device {self.device!r}; use one of "
                             f"{sorted(KNOWN_DEVICES) + [CPU_DEVICE]}")
        return self


class ServerSpec(_Strict):
    block_size: int = Field(16, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    max_num_batched_tokens: int = Field(8192, gt=0)
    allreduce_latency_us: float = Field(
        20.0, ge=0, description="latency of one hop of a tensor-parallel all-reduce (an "
        "assumption of the order NCCL reaches on small messages; not measured here)")
    scheduling: Literal["chunked", "prefill_first"] = Field(
        "chunked", description="chunked: vLLM v1's steps, decodes with prompt chunks beside "
        "them; prefill_first: vLLM 0.6 without chunked prefill, the Weaver paper's engine "
        "(whole prompts first, decodes wait)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_gib: float = Field(2.0, ge=0)


class WeavingSpec(_Strict):
    offload_policy: Literal["fixed", "overflow", "ratio"] = Field(
        "fixed", description="fixed: keep offload_ratio of the running sequences remote; "
        "overflow: place a sequence remotely only when local KV is full; ratio: the "
        "deployment's own placement (weaver.weaving.placement.RatioPlacement, with spill)")
    offload_ratio: float = Field(0.5, ge=0, le=1, description="target share of remote seqs "
                                 "(fixed) or the cap on it (overflow)")
    region_fraction: float = Field(0.5, ge=0, le=1,
                                   description="share of the cold device's KV memory lent")
    poll_overhead_us: float = Field(20.0, ge=0, description="per cold step, polling cost")
    idle_poll_interval_us: float = Field(IDLE_POLL_INTERVAL_S * 1e6, gt=0)
    split: Literal["none", "plan"] | dict[str, int] = Field(
        "none", description="operator splitting of the cold model (Weaver §4): none; plan: "
        "Algorithm 1's chunks for the modelled operators (weaver/splitting/algorithm.py); "
        "or chunks per operator kind, as a deployment's `split` ({lm_head: 16}). A task "
        "then waits behind a chunk, not a whole operator")
    control: Literal["gpu", "cpu"] = Field(
        "gpu", description="how the cold side finds a task (the paper's ablation, its "
        "Fig. 7a): gpu: a poll kernel between its operators (GPU-driven control flow); cpu: "
        "the host launches the task on the cold stream, where it waits behind the step's "
        "pre-submitted kernels (the whole step is one wait, no poll cost, no split)")
    chunk_overhead_us: float = Field(4.0, ge=0, description="what one more chunk adds to "
                                     "the cold step (a launch and a poll; ~4 us measured "
                                     "per poll launch on an H100, benchmarks/GPU_RUNBOOK.md)")

    @field_validator("split")
    @classmethod
    def _check_split(cls, value: Any) -> Any:
        if isinstance(value, dict):
            from weaver.splitting.deploy import validate_split_chunks

            return validate_split_chunks(dict(value))
        return value

    @model_validator(mode="after")
    def _check_control(self) -> WeavingSpec:
        if self.control == "cpu" and self.split != "none":
            raise ValueError("weaving.split needs control: gpu (a host-launched task waits "
                             "behind the whole pre-submitted step, however it is cut); set "
                             "split: none or control: gpu")
        return self


class SplitwiseSpec(_Strict):
    prompt_fraction: float = Field(0.5, gt=0, lt=1, description="share of a model's GPUs "
                                   "in the prompt pool")
    first_token: Literal["prompt", "token"] = Field(
        "prompt", description="where the client's first token comes from: the prompt "
        "instance at the end of the prefill (the paper's Splitwise), or the token instance's "
        "first step with the moved KV (Weaver's phase split: the token engine computes the "
        "prompt's last token itself, weaver/vllm_ext/kv_connector.py)")


class MuxServeSpec(_Strict):
    rebalance_interval_s: float = Field(1.0, gt=0, description="ADBS quota re-balancing")
    overlap_speed: float = Field(
        0.5, gt=0, le=1, description="spatial-temporal groups: the speed of each of two "
        "overlapping steps, relative to running alone. 0.5: they share the device evenly "
        "(CPU cores, both engines' threads on all of them); above 0.5 when the two steps "
        "use different resources (a compute-bound prefill beside a memory-bound decode, "
        "MuxServe's premise on a GPU)")
    contended_speed: float = Field(
        1.0, gt=0, le=1, description="the speed of a step while another model of its group "
        "has work too, relative to the group's other engines idle: what their processes "
        "cost it beside the compute they take in turn (on CPU, their schedulers and "
        "frontends on the same cores; benchmarks/mux_contention.py measures it)")


class SloSpec(_Strict):
    ttft_s: float = Field(10.0, gt=0)
    tpot_ms: float = Field(100.0, gt=0)


class MuxSpec(_Strict):
    """How the models of one GPU take turns (policies muxserve and weaver), as a
    deployment's mux group does (weaver/mux/turns.py)."""

    mode: Literal["temporal", "spatial-temporal"] = Field(
        "temporal", description="temporal: one step at a time; spatial-temporal: a prefill "
        "may run beside another model's decode (muxserve.overlap_speed)")
    weights: dict[str, float] = Field(default_factory=dict, description="decode share of "
                                      "each model; unset: its rate per replica")
    skip_limit: int = Field(DEFAULT_SKIP_LIMIT, ge=1,
                            description="most times a waiting step is passed over")
    own_kv: bool = Field(False, description="each model keeps its own num_blocks (a "
                         "deployment's engines); false: one pool with ADBS quotas")


class GpuSpec(_Strict):
    models: list[str] = Field(min_length=1)
    role: Literal["both", "prompt", "token"] = "both"
    tp: int = Field(1, ge=1, description="GPUs this entry spans, its models sharded over "
                    "them with tensor parallelism (MuxServe's GPU meshes): the work of a step "
                    "split tp ways, plus two all-reduces per layer over the device link")
    mux: MuxSpec | None = Field(None, description="turn-taking of the GPU's models; "
                                "default: temporal, weights by rate, ADBS quotas")


class PairSpec(_Strict):
    hot_gpu: int = Field(ge=0)
    cold_gpu: int = Field(ge=0)
    offload_ratio: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] | None = Field(
        None, description="a fixed share of remote sequences, or auto (the hot scheduler's "
        "adaptive placement, weaver/weaving/placement.py); default: weaving.offload_ratio")
    remote_blocks: int | None = Field(None, gt=0, description="blocks of the hot model "
                                      "lent by the cold side (a deployment's lend_kv_gib); "
                                      "default: weaving.region_fraction of its KV memory")
    hot_tpot_ms: float | None = Field(None, gt=0, description="offload_ratio auto: the hot "
                                      "TPOT target (a deployment's hot_tpot_ms); default: "
                                      "relative to its local-only steps")
    cold_tpot_budget: float = Field(1.10, ge=1, description="offload_ratio auto: how much "
                                    "the cold model's TPOT may grow")
    loan_quota_blocks: int | None = Field(
        None, gt=0, description="a loan pool (weaver/weaving/plan.py plan_loan_pools): the "
        "cold GPU's pairs that set this share one pool of remote_blocks (the whole loan), "
        "each hot model holding at most this many blocks of it (the loan less one "
        "max_model_len sequence of each other hot model, the floor ADBS keeps them); "
        "default: a region of remote_blocks of its own")


class PlacementSpec(_Strict):
    gpus: list[GpuSpec]
    pairs: list[PairSpec] = []


class SweepSpec(_Strict):
    model: str = Field(description="the model whose rate is swept")
    rates: list[float] = Field(min_length=1)
    policies: list[str] = Field(min_length=1)
    num_seeds: int = Field(3, ge=1, description="each rate is simulated with the seeds "
                           "seed, seed+1, ...; a max rate pools them (attainment and mean "
                           "TPOT averaged over the seeds at each rate), and each seed's own "
                           "max rate gives the spread")
    placements: dict[str, PlacementSpec] = Field(
        default_factory=dict, description="a placement of its own for a policy (e.g. "
        "MuxServe's models sharing a tensor-parallel mesh while dedicated gives each its "
        "GPU); the others use the config's placement")


class SimConfig(_Strict):
    name: str
    seed: int = 0
    duration_s: float = Field(60.0, gt=0, description="arrivals are generated over this")
    drain_s: float = Field(90.0, ge=0, description="simulate at most this long after the "
                           "arrival window; requests unfinished by then count as missed")
    policy: str = "dedicated"
    workload: WorkloadConfig = WorkloadConfig()
    models: list[ModelSpec] = []
    model_set: ModelSetSpec | None = None
    cluster: ClusterSpec
    server: ServerSpec = ServerSpec()
    weaving: WeavingSpec = WeavingSpec()
    splitwise: SplitwiseSpec = SplitwiseSpec()
    muxserve: MuxServeSpec = MuxServeSpec()
    slo: SloSpec = SloSpec()
    placement: PlacementSpec | None = None
    sweep: SweepSpec | None = None
    plan_candidates: int = Field(3, gt=0, description="planner: plans simulated in full")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.model_set is not None:
            if self.models:
                raise ValueError("give either `models` or `model_set`, not both")
            self.models = self.model_set.expand()
        if not self.models:
            raise ValueError("no models: add a `models:` list or a `model_set:`")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        for policy in [self.policy] + (self.sweep.policies if self.sweep else []):
            if policy not in POLICY_NAMES:
                raise ValueError(f"unknown policy {policy!r}; use one of {POLICY_NAMES}")
        if self.sweep and self.sweep.model not in names:
            raise ValueError(f"sweep.model {self.sweep.model!r} is not one of {names}")
        if self.placement:
            _check_placement(self.placement, names, self.cluster.num_gpus)
        for policy, placement in (self.sweep.placements if self.sweep else {}).items():
            if policy not in self.sweep.policies:
                raise ValueError(f"sweep.placements names {policy!r}, which is not one of "
                                 f"sweep.policies {self.sweep.policies}")
            _check_placement(placement, names, self.cluster.num_gpus)
        if self.cluster.device == CPU_DEVICE:
            _check_cpu_models(self.models)
        return self

    def model(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)

    def with_rate(self, model: str, rate: float) -> SimConfig:
        """This config with one model's request rate changed (a sweep's point)."""
        return self.model_copy(update={"models": [
            m.model_copy(update={"rate": rate}) if m.name == model else m
            for m in self.models]})


def _check_placement(placement: PlacementSpec, names: list[str], num_gpus: int) -> None:
    used = sum(gpu.tp for gpu in placement.gpus)
    if used > num_gpus:
        raise ValueError(f"placement uses {used} GPUs but the cluster has "
                         f"{num_gpus}; raise cluster.num_gpus or remove GPUs")
    for i, gpu in enumerate(placement.gpus):
        unknown = set(gpu.models) - set(names)
        if unknown:
            raise ValueError(f"placement.gpus[{i}] names unknown models {sorted(unknown)}")
        stray = set(gpu.mux.weights) - set(gpu.models) if gpu.mux else set()
        if stray:
            raise ValueError(f"placement.gpus[{i}].mux.weights names {sorted(stray)}, which "
                             f"are not on that GPU ({gpu.models})")
    for pair in placement.pairs:
        if max(pair.hot_gpu, pair.cold_gpu) >= len(placement.gpus) or \
                pair.hot_gpu == pair.cold_gpu:
            raise ValueError(f"weaving pair {pair} must name two different GPUs of the "
                             f"placement (0..{len(placement.gpus) - 1})")


def _check_cpu_models(models: list[ModelSpec]) -> None:
    # No published peak numbers describe one core of this machine, so there is no
    # roofline to fall back on, and its KV is what the engine was given, in blocks.
    for m in models:
        if m.profile is None or m.num_blocks is None:
            raise ValueError(f"model {m.name!r} on device cpu needs a measured `profile:` "
                             "(weaver profile --engine) and `num_blocks:`")


def load_config(path: str | Path) -> SimConfig:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist; see weaver/sim/configs/ for "
                         "examples")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping at top level (name:, cluster:, ...)")
    try:
        return SimConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"{path} is not a valid simulation config:\n{exc}") from exc


def packaged_configs() -> dict[str, Path]:
    folder = Path(__file__).parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}
