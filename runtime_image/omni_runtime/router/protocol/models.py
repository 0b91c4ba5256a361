"""`GET /v1/models`: the one model the router serves."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["ModelCard", "ModelList"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "omnikube"
    root: str | None = None
    pipeline: str | None = None
    modalities: list[str] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
