"""The policy interface: build instances from a plan, then route each arriving request."""

from __future__ import annotations

from abc import ABC, abstractmethod

from weaver.sim.cluster import Cluster
from weaver.sim.engine import Event
from weaver.sim.instance import Instance, SimRequest
from weaver.sim.plan import Plan


class Policy(ABC):
    name = ""

    def __init__(self, cluster: Cluster, plan: Plan) -> None:
        self.cluster = cluster
        self.plan = plan
        self.instances: list[Instance] = []
        self.routes: dict[str, list[Instance]] = {}
        self.build()
        missing = [m.name for m in cluster.config.models if not self.routes.get(m.name)]
        if missing:
            raise ValueError(f"policy {self.name}: models {missing} are on no GPU of the "
                             "plan; add them to placement.gpus")

    @abstractmethod
    def build(self) -> None:
        """Create `self.instances` and `self.routes` (model -> instances taking arrivals)."""

    def add_instance(self, instance: Instance, routed: bool = True) -> None:
        self.instances.append(instance)
        if routed:
            for model in instance.servers:
                self.routes.setdefault(model, []).append(instance)

    def route(self, req: SimRequest, now: float) -> list[Event]:
        """Join-the-shortest-queue among the model's instances (ties: lowest index)."""
        target = shortest_queue(self.routes[req.model], req.model)
        return target.submit(req, now)


def shortest_queue(instances: list[Instance], model: str) -> Instance:
    return min(instances, key=lambda inst: inst.servers[model].num_queued)
