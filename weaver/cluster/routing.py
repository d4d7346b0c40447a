"""The ingress's choice of group for a model, and its answers that need no group. Pure
Python (the Ray Serve deployment in ray_app.py holds one)."""

from __future__ import annotations

import time
from typing import Any


class ModelRouter:
    """model -> the groups serving it; a request goes to the one with the fewest requests
    in flight from this ingress (ties: the group named first), so replicas of a model in
    several groups share its load."""

    def __init__(self, groups_of: dict[str, list[str]]) -> None:
        if not groups_of or any(not groups for groups in groups_of.values()):
            raise ValueError(f"every model needs a group: {groups_of}")
        self._groups_of = {model: list(groups) for model, groups in groups_of.items()}
        self._in_flight: dict[str, int] = {g: 0 for gs in groups_of.values() for g in gs}
        self._created = int(time.time())

    @property
    def model_names(self) -> list[str]:
        return sorted(self._groups_of)

    def choose(self, model: Any) -> str | None:
        """The group for a request naming `model`; None when no group serves it."""
        candidates = self.candidates(model)
        return candidates[0] if candidates else None

    def candidates(self, model: Any) -> list[str]:
        """The groups serving `model`, the least busy first: where to try it, in order."""
        groups = self._groups_of.get(model) if isinstance(model, str) else None
        if not groups:
            return []
        return sorted(groups, key=lambda g: (self._in_flight[g], groups.index(g)))

    def started(self, group: str) -> None:
        self._in_flight[group] += 1

    def finished(self, group: str) -> None:
        self._in_flight[group] = max(0, self._in_flight[group] - 1)

    def in_flight(self, group: str) -> int:
        return self._in_flight[group]

    def models_listing(self) -> dict[str, Any]:
        """/v1/models as OpenAI's API shapes it: every model of the cluster once."""
        return {"object": "list", "data": [
            {"id": model, "object": "model", "created": self._created, "owned_by": "weaver"}
            for model in self.model_names]}  # fmt: skip


def openai_error(model: Any, known: list[str]) -> tuple[int, dict[str, Any]]:
    """(status, body) for a request whose model no group serves, as vLLM's server words
    it: 400 without a model, 404 for an unknown one, naming the models there are."""
    if not isinstance(model, str) or not model:
        return 400, {"error": {"message": "the request names no `model`; one of "
                               f"{known}", "type": "BadRequestError", "code": 400}}
    return 404, {"error": {"message": f"The model `{model}` does not exist. Models of this "
                           f"cluster: {known}", "type": "NotFoundError", "code": 404}}
