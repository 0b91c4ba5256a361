"""Serving `GET /v1/models`."""

from __future__ import annotations

from omni_runtime.router.protocol.models import ModelCard, ModelList
from omni_runtime.router.serving.base import ServingBase

__all__ = ["ServingModels"]


class ServingModels(ServingBase):
    endpoint = "/v1/models"

    def list(self) -> ModelList:
        card = ModelCard(
            id=self.ctx.model_name,
            root=self.pipeline.model,
            pipeline=self.topology.name,
            modalities=self.producible(),
        )
        return ModelList(data=[card])
