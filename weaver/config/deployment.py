"""The deployment file: which models Weaver serves, where, and how they weave.

A YAML file validated by pydantic. Every error names the offending field and says how to
fix it, because this file is the first thing a user writes.
"""

from __future__ import annotations

import re
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from weaver.config.cpu_cores import parse_cpu_cores
from weaver.config.serving import ServingSpec

DEFAULT_DEPLOYMENT_RESOURCE = "default.yaml"

# An API model name travels in URLs, metric labels and (sanitised) shared-memory names;
# it may be a Hugging Face id, org/name, as `vllm serve` names a model by default.
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?$")
_DEVICE_RE = re.compile(r"^(cpu|cuda:\d+)$")


def _check_model_name(value: str) -> str:
    if not _MODEL_NAME_RE.match(value):
        raise ValueError(
            f"model name {value!r} must be 1-64 characters of letters, digits, '.', '_' "
            "or '-', starting with a letter or digit, optionally followed by one "
            "'/name' part of the same kind (a Hugging Face id, org/name)"
        )
    return value


class Role(str, Enum):
    DEDICATED = "dedicated"  # serves only itself
    HOT = "hot"  # popular: may place some sequences on cold models' devices
    COLD = "cold"  # unpopular: lends memory and attention time to hot models


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False)

    name: str = Field(description="API model name, the `model` field of requests")
    model: str = Field(description="a prepared model name (weaver models list), a directory, "
                       "or a Hugging Face model id (org/name) as `vllm serve` takes it")
    role: Role = Role.DEDICATED
    device: str = Field(
        "cpu", description="cpu or cuda:N (N as this process numbers its visible GPUs); the "
        "engine's processes see that GPU as their only one (a hot model also sees its cold "
        "models' GPUs), see weaver/config/devices.py")
    kv_cache_gib: float = Field(0.5, gt=0, description="the engine's own KV-cache budget, GiB")
    gpu_memory_gib: float | None = Field(
        None, gt=0,
        description="cuda device: the engine's whole budget on its GPU, GiB: weights, "
        "activations, kv_cache_gib and, for a cold model, lend_kv_gib (vLLM gets it as "
        "--gpu-memory-utilization); default: weights + kv_cache_gib + lend_kv_gib + 2 GiB")
    max_model_len: int = Field(2048, ge=16, description="longest prompt + output, tokens")
    dtype: str = Field("float32", description="weights/activations dtype (float32 on CPU)")
    block_size: int | None = Field(None, ge=1, description="KV block size; engine default if unset")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one batch")
    lend_kv_gib: float = Field(0.0, ge=0, description="cold role: memory lent to hot models, "
                               "GiB; several hot models share it by demand (docs/weaving.md)")
    num_gpu_blocks_override: int | None = Field(
        None, ge=1, description="cap the engine's own KV blocks (benchmarks of KV-bound load)"
    )
    cpu_cores: str | None = Field(
        None,
        description="cpu device: cores for this engine in vLLM's VLLM_CPU_OMP_THREADS_BIND "
        "syntax ('0', '0-1', 'nobind'); vLLM binds its worker's threads to them and Weaver "
        "pins its scheduler process there too; default: vLLM's choice",
    )
    extra_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="more vLLM engine arguments, by the Python name of "
        "their `vllm serve` flag (enable_prefix_caching: false); checked by vLLM's parser "
        "at `weaver config` time"
    )
    vllm_flags: list[str] = Field(
        default_factory=list, description="more `vllm serve` flags as they are typed "
        "(['--max-num-batched-tokens', '64']), after Weaver's own and extra_engine_args, "
        "so they win; `weaver serve MODEL FLAGS...` puts its flags here"
    )
    split: Literal["auto"] | dict[str, int] | None = Field(
        None,
        description="cold role: split long operators so offloaded attention waits less "
        "(docs/architecture.md, part 7). 'auto': Algorithm 1 on the saved profile (split_profile, "
        "else the one `weaver plan-split CONFIG --measure` saved for this model); or chunks "
        "per operator, e.g. {gate_up: 4, lm_head: 16}; unset: no splitting",
    )
    split_profile: str | None = Field(
        None, description="cold role with split: auto: the operator profile JSON to plan from"
    )
    unified_kv: bool = Field(
        False,
        description="cold role: keep the model's own KV cache and the memory it lends in one "
        "pool (kv_cache_gib + lend_kv_gib) whose pages go to the cold model or its hot "
        "models by quota (docs/architecture.md, part 8). Pages hold one head-block of the cold "
        "model; each hot model's block_size must make its head-blocks the same size",
    )
    max_waiting_requests: int = Field(
        256, ge=0, description="requests the gateway lets wait beyond a full batch "
        "(max_num_seqs running); more are answered 429 with Retry-After")
    timeout_s: float | None = Field(
        None, gt=0, description="longest a request may take; past it the request is aborted "
        "in its engine (its KV freed) and answered 504. A request's X-Request-Timeout header "
        "(seconds) overrides it; unset: no deadline")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        return _check_model_name(value)

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE_RE.match(value):
            raise ValueError(f"device {value!r} is not 'cpu' or 'cuda:N' (e.g. 'cuda:0')")
        return value

    @field_validator("cpu_cores")
    @classmethod
    def _check_cpu_cores(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_cores(value)  # ValueError says what is wrong
        return value

    @field_validator("split")
    @classmethod
    def _check_split(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for op, chunks in value.items():
                if chunks < 1:
                    raise ValueError(f"split: chunks for {op!r} must be >= 1, got {chunks}")
        return value

    @model_validator(mode="after")
    def _check_split_role(self) -> ModelSpec:
        if (self.split is not None or self.split_profile) and self.role is not Role.COLD:
            raise ValueError(
                f"model {self.name!r}: split/split_profile are set but role is "
                f"{self.role.value!r}; only a cold model splits its operators (set role: "
                "cold or remove split)"
            )
        if self.split_profile and self.split != "auto":
            raise ValueError(f"model {self.name!r}: split_profile is only read with "
                             "split: auto")
        return self

    @model_validator(mode="after")
    def _check_device_fields(self) -> ModelSpec:
        on_gpu = self.device != "cpu"
        if on_gpu and self.cpu_cores is not None:
            raise ValueError(f"model {self.name!r}: cpu_cores binds a cpu engine's threads; "
                             f"it is on {self.device} (remove cpu_cores)")
        if not on_gpu and self.gpu_memory_gib is not None:
            raise ValueError(f"model {self.name!r}: gpu_memory_gib is for a cuda device; on "
                             "cpu, kv_cache_gib is the engine's budget (remove gpu_memory_gib)")
        if on_gpu and self.unified_kv:
            raise ValueError(f"model {self.name!r}: the unified KV pool runs on cpu engines "
                             "only so far; remove unified_kv or set device: cpu")
        return self

    @model_validator(mode="after")
    def _check_lend(self) -> ModelSpec:
        if self.lend_kv_gib > 0 and self.role is not Role.COLD:
            raise ValueError(
                f"model {self.name!r}: lend_kv_gib is set but role is {self.role.value!r}; "
                "only a cold model lends memory (set role: cold or remove lend_kv_gib)"
            )
        if self.unified_kv and self.role is not Role.COLD:
            raise ValueError(f"model {self.name!r}: unified_kv is for cold models only")
        if self.unified_kv and self.num_gpu_blocks_override is not None:
            raise ValueError(f"model {self.name!r}: with unified_kv the pool's quota, not "
                             "num_gpu_blocks_override, bounds the model's KV")
        return self


class WeavingSpec(BaseModel):
    """One hot model weaving into one or more cold models."""

    model_config = ConfigDict(extra="forbid")

    hot: str = Field(description="name of a model with role: hot")
    cold: list[str] = Field(min_length=1, description="names of models with role: cold")
    offload_ratio: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = Field(
        "auto", description="auto: local first, and remote only when the hot model's KV is "
        "full and weaving pays (its TPOT target, the cold model's budget and the measured "
        "throughput gain; weaver/weaving/placement.py); or a fixed share of sequences "
        "placed remotely, in [0, 1]")
    hot_tpot_ms: float | None = Field(
        None, gt=0, description="offload_ratio auto: the hot model's TPOT target in ms; "
        "weaving steps aside when woven steps exceed it (default: 1.25x its local-only step)")
    cold_tpot_budget: float = Field(
        1.10, ge=1.0, description="offload_ratio auto: the cold model's TPOT may grow at most "
        "this factor over its TPOT with no offload, or weaving steps aside")
    timeout_s: float = Field(5.0, gt=0, description="longest wait for a cold model's answer")


MuxMode = Literal["temporal", "spatial-temporal"]


class MuxGroupSpec(BaseModel):
    """Models colocated on one set of devices, taking turns step by step (MuxServe)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the group's name (its turn table is named after it)")
    models: list[str] = Field(min_length=2, description="names of dedicated models that "
                              "share the group's devices")
    mode: MuxMode = Field(
        "spatial-temporal",
        description="temporal: one model's step at a time (Mux-Temporal); spatial-temporal: "
        "a prefill of one model may run beside a decode step of another (MuxServe); either "
        "way prefill steps go first and decode steps share the rest by rate "
        "(weaver/mux/turns.py)")
    cpu_cores: str | None = Field(
        None, description="cpu device: the cores every engine of the group is bound to "
        "(VLLM_CPU_OMP_THREADS_BIND syntax); default: vLLM's choice")
    rates: dict[str, float] = Field(
        default_factory=dict, description="request rate (req/s) of each model: the weights "
        "of the decode round-robin, so a popular model gets its share; unset: equal")
    skip_limit: int = Field(4, ge=1, description="most times a waiting step may be passed "
                            "over before it goes first (no model starves)")
    unified_kv: bool = Field(
        False, description="keep the group's KV in one pool (MuxServe's unified KV cache): "
        "each model starts with its own KV budget as its quota and ADBS moves quota to the "
        "model that is short (weaver/kv/adbs.py), never below one max_model_len sequence. "
        "Pages are one head-block of the first model; every model needs the same dtype and "
        "a block_size that fills them; the engines run without prefix caching; "
        "false: each engine keeps its own KV")

    @field_validator("name")
    @classmethod
    def _check_group_name(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", value):
            raise ValueError(f"mux group name {value!r} must be 1-64 letters, digits, '.', "
                             "'_' or '-'")
        return value

    @field_validator("cpu_cores")
    @classmethod
    def _check_group_cores(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_cores(value)
        return value

    @model_validator(mode="after")
    def _check_rates(self) -> MuxGroupSpec:
        stray = sorted(set(self.rates) - set(self.models))
        if stray:
            raise ValueError(f"mux group {self.name!r}: rates names {stray}, which are not "
                             f"in its models {self.models}")
        if any(rate <= 0 for rate in self.rates.values()):
            raise ValueError(f"mux group {self.name!r}: every rate must be > 0 req/s")
        return self

    def weight(self, model: str) -> float:
        """The model's weight in the decode round-robin: its rate, else 1."""
        return self.rates.get(model, 1.0)


class PhaseSplitSpec(BaseModel):
    """One model served Splitwise-style: prompt engines run each request's prefill, token
    engines its decode, and the prompt's KV moves between them (weaver/server/
    phase_split.py, docs/architecture.md part 12)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the API model name clients send; its engines are "
                       "the models named in prefill and decode, which clients do not see")
    prefill: list[str] = Field(min_length=1, description="names of dedicated models that "
                               "run prompts (Splitwise's prompt instances)")
    decode: list[str] = Field(min_length=1, description="names of dedicated models that "
                              "generate the tokens (token instances); each request goes to "
                              "the one with the least KV in use")

    @field_validator("model")
    @classmethod
    def _check_model_name(cls, value: str) -> str:
        return _check_model_name(value)

    @property
    def engines(self) -> list[str]:
        return [*self.prefill, *self.decode]


def _asks_for_prefix_caching(spec: ModelSpec) -> bool:
    return (spec.extra_engine_args.get("enable_prefix_caching") is True
            or "--enable-prefix-caching" in spec.vllm_flags)


class Deployment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[ModelSpec] = Field(min_length=1)
    weaving: list[WeavingSpec] = Field(default_factory=list)
    mux: list[MuxGroupSpec] = Field(default_factory=list, description="colocated groups")
    phase_split: list[PhaseSplitSpec] = Field(
        default_factory=list, description="models whose prefill and decode run on separate "
        "engines (Splitwise)")
    serving: ServingSpec = Field(default_factory=ServingSpec)

    @model_validator(mode="after")
    def _check_references(self) -> Deployment:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model names must be unique; repeated: {duplicates}")
        by_name = {m.name: m for m in self.models}
        for pair in self.weaving:
            self._check_pair(pair, by_name)
        hots = [p.hot for p in self.weaving]
        if len(hots) != len(set(hots)):
            raise ValueError("each hot model may appear in only one weaving entry")
        self._check_mux_groups(by_name)
        self._check_phase_splits(by_name)
        return self

    def _check_phase_splits(self, by_name: dict[str, ModelSpec]) -> None:
        owner: dict[str, str] = {}
        for split in self.phase_split:
            where = f"phase_split {split.model!r}"
            if split.model in by_name or split.model in owner.values():
                raise ValueError(f"{where}: the name is taken by a model or another phase "
                                 "split; clients send it, so give it a name of its own")
            for name in split.engines:
                spec = by_name.get(name)
                if spec is None:
                    raise ValueError(f"{where} names {name!r}, which is not in models: "
                                     f"{sorted(by_name)}")
                if name in owner:
                    twice = (f"twice in phase_split {split.model!r}"
                             if owner[name] == split.model else
                             f"in phase_splits {owner[name]!r} and {split.model!r}")
                    raise ValueError(f"model {name!r} is {twice}; an engine serves one "
                                     "phase of one model")
                owner[name] = split.model
                if spec.role is not Role.DEDICATED or self.mux_group_of(name) is not None:
                    raise ValueError(f"{where}: {name!r} must be a dedicated model in no mux "
                                     "group (phase splitting is compared with weaving and "
                                     "muxing, not combined with them)")
                if spec.device != "cpu":
                    raise ValueError(
                        f"{where}: {name!r} is on {spec.device}; a phase split moves KV "
                        "through shared memory between cpu engines so far (on GPUs, vLLM's "
                        "NixlConnector is the way: see docs/phase-split.md)")
            first = by_name[split.prefill[0]]
            for name in split.engines[1:]:
                spec = by_name[name]
                for field_name in ("model", "dtype", "block_size", "max_model_len"):
                    if getattr(spec, field_name) != getattr(first, field_name):
                        raise ValueError(
                            f"{where}: {name!r} has {field_name} "
                            f"{getattr(spec, field_name)!r} but {first.name!r} has "
                            f"{getattr(first, field_name)!r}; a prompt's KV moves between "
                            "these engines block by block, so they must agree")

    @property
    def served_names(self) -> list[str]:
        """The model names clients send: every model but a phase split's engines, then each
        phase split's own name."""
        members = {name for split in self.phase_split for name in split.engines}
        return ([m.name for m in self.models if m.name not in members]
                + [split.model for split in self.phase_split])

    def phase_split_of(self, engine: str) -> tuple[PhaseSplitSpec, str] | None:
        """(the phase split an engine serves, "prefill" or "decode"), or None."""
        for split in self.phase_split:
            if engine in split.prefill:
                return split, "prefill"
            if engine in split.decode:
                return split, "decode"
        return None

    def _check_mux_groups(self, by_name: dict[str, ModelSpec]) -> None:
        seen: dict[str, str] = {}
        groups = [g.name for g in self.mux]
        if len(groups) != len(set(groups)):
            raise ValueError(f"mux group names must be unique; got {groups}")
        for group in self.mux:
            for name in group.models:
                spec = by_name.get(name)
                if spec is None:
                    raise ValueError(f"mux group {group.name!r} names {name!r}, which is not "
                                     f"in models: {sorted(by_name)}")
                if name in seen:
                    raise ValueError(f"model {name!r} is in mux groups {seen[name]!r} and "
                                     f"{group.name!r}; a model shares one set of devices")
                seen[name] = group.name
                if spec.role is not Role.DEDICATED:
                    raise ValueError(f"mux group {group.name!r}: {name!r} has role "
                                     f"{spec.role.value!r}; a colocated model is dedicated "
                                     "(weaving and muxing are compared, not combined)")
                if spec.device != "cpu":
                    raise ValueError(f"mux group {group.name!r}: {name!r} is on {spec.device}; "
                                     "colocated groups run on cpu engines only so far")
                if group.unified_kv and _asks_for_prefix_caching(spec):
                    raise ValueError(
                        f"mux group {group.name!r} keeps its KV in one pool, whose engines "
                        f"run without prefix caching, but {name!r} turns it on; remove "
                        "enable_prefix_caching from its extra_engine_args / vllm_flags")
                if group.cpu_cores is not None:
                    if spec.cpu_cores not in (None, group.cpu_cores):
                        raise ValueError(
                            f"mux group {group.name!r} binds its engines to cores "
                            f"{group.cpu_cores!r} but {name!r} says cpu_cores "
                            f"{spec.cpu_cores!r}; remove the model's cpu_cores")
                    spec.cpu_cores = group.cpu_cores

    def mux_group_of(self, model: str) -> MuxGroupSpec | None:
        return next((g for g in self.mux if model in g.models), None)

    @staticmethod
    def _check_pair(pair: WeavingSpec, by_name: dict[str, ModelSpec]) -> None:
        if len(set(pair.cold)) != len(pair.cold):
            raise ValueError(f"weaving {pair.hot!r} lists a cold model twice: {pair.cold}")
        for name, role in [(pair.hot, Role.HOT)] + [(c, Role.COLD) for c in pair.cold]:
            spec = by_name.get(name)
            if spec is None:
                known = sorted(by_name)
                raise ValueError(f"weaving names {name!r}, which is not in models: {known}")
            if spec.role is not role:
                raise ValueError(
                    f"weaving uses {name!r} as {role.value} but its role is {spec.role.value!r}"
                )
            if role is Role.COLD and spec.lend_kv_gib <= 0:
                raise ValueError(f"cold model {name!r} must lend memory: set lend_kv_gib > 0")
        hot = by_name[pair.hot]
        for name in pair.cold:
            cold = by_name[name]
            if (hot.device == "cpu") != (cold.device == "cpu"):
                raise ValueError(
                    f"weaving {hot.name!r} ({hot.device}) -> {name!r} ({cold.device}): a pair "
                    "shares memory, so both run on cpu or both on cuda (the same GPU or two "
                    "GPUs of one machine); change one model's device")

    def model(self, name: str) -> ModelSpec:
        for spec in self.models:
            if spec.name == name:
                return spec
        raise KeyError(name)


def parse_deployment(data: Any, source: str = "<deployment>") -> Deployment:
    """Validate parsed YAML; raise ValueError with one line per problem."""
    try:
        return Deployment.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_explain(exc, source)) from None


def load_deployment(path: str | Path | None = None) -> Deployment:
    """Load a deployment file, or the embedded default when `path` is None."""
    if path is None:
        text = resources.files("weaver.config").joinpath(DEFAULT_DEPLOYMENT_RESOURCE).read_text()
        source = "embedded default deployment"
    else:
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"deployment file {str(file)!r} does not exist")
        text, source = file.read_text(), str(file)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with a 'models' list at the top level")
    return parse_deployment(data, source)


def _explain(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: {exc.error_count()} problem(s) in the deployment:"]
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field; check its spelling against `weaver config --schema`"
        lines.append(f"  - {where}: {message}")
    return "\n".join(lines)
