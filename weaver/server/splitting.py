"""Operator splitting in the serve lifecycle: each engine's split plan (the chunks per
operator kind its `split` setting names: weaver/splitting/deploy.py) in its `weaver`
block, where the worker applies it (weaver/vllm_ext/layers.py)."""

from __future__ import annotations

from typing import Any

from weaver.config.deployment import Deployment
from weaver.server.features import ServeFeature
from weaver.splitting.deploy import split_chunks_for
from weaver.vllm_ext.additional_config import split_section_for


class OperatorSplitting(ServeFeature):
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    def engine_section(self, model: str) -> dict[str, Any]:
        return split_section_for(split_chunks_for(self.deployment.model(model)))
