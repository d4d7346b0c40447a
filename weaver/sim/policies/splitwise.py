"""Splitwise (Patel et al., ISCA'24): each model's GPUs form a prompt pool and a token pool.

Prompts are routed to the prompt instance with the shortest queue (JSQ, Splitwise §4.3);
after prefill the KV cache crosses the link to the token instance with the shortest queue,
which admits the request into its decode batch once the transfer completes. The prompt
instance frees the KV when the transfer starts (Splitwise overlaps the transfer with
prefill layer by layer, so it holds the blocks only briefly). A model with a single GPU
cannot split and runs both phases there."""

from __future__ import annotations

from weaver.sim.engine import Event
from weaver.sim.instance import Instance, SimRequest
from weaver.sim.perf_model import kv_transfer_time
from weaver.sim.policies.base import Policy, shortest_queue


class SplitwisePolicy(Policy):
    name = "splitwise"

    def build(self) -> None:
        self.token_pools: dict[str, list[Instance]] = {}
        roles = self._roles()
        for i, gpu in enumerate(self.plan.gpus):
            if len(gpu.models) != 1:
                raise ValueError(f"splitwise needs one model per GPU, GPU {i} has {gpu.models}")
            model = gpu.models[0]
            role = roles[i]
            inst = self.cluster.make_instance(f"gpu{i}-{role}", gpu.models, phase=role,
                                              tp=gpu.tp)
            self.add_instance(inst, routed=role != "token")
            if role == "prompt":
                inst.servers[model].on_prefilled = self._hand_off
            if role == "token":
                self.token_pools.setdefault(model, []).append(inst)
                first_token = self.cluster.config.splitwise.first_token
                inst.servers[model].first_token_here = first_token == "token"

    def _roles(self) -> list[str]:
        """Explicit roles from the plan, or split each model's GPUs by prompt_fraction."""
        roles = [g.role for g in self.plan.gpus]
        fraction = self.cluster.config.splitwise.prompt_fraction
        for model in {g.models[0] for g in self.plan.gpus}:
            gpus = self.plan.gpus_of(model)
            if any(roles[i] != "both" for i in gpus) or len(gpus) < 2:
                continue
            num_prompt = min(max(round(fraction * len(gpus)), 1), len(gpus) - 1)
            for k, i in enumerate(gpus):
                roles[i] = "prompt" if k < num_prompt else "token"
        return roles

    def _hand_off(self, req: SimRequest, now: float) -> list[Event]:
        pool = self.token_pools.get(req.model)
        if not pool:
            raise ValueError(f"model {req.model} has a prompt pool but no token pool; give "
                             "it a GPU with role: token")
        target = shortest_queue(pool, req.model)
        target.servers[req.model].num_in_flight += 1
        delay = kv_transfer_time(self.cluster.perf(req.model), self.cluster.link(req.model),
                                 req.trace.input_tokens + req.num_done - 1)
        req.has_kv = True

        def arrive(t: float) -> list[Event]:
            target.servers[req.model].num_in_flight -= 1
            return target.submit(req, t)

        return [self.cluster.engine.event(now + delay, "splitwise.kv_arrive", arrive)]
