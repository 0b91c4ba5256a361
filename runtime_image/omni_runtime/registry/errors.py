"""Errors the registry raises; each message says what was found and what to change."""

from __future__ import annotations

from typing import ClassVar

from omni_runtime.spec import SpecError
from omni_runtime.spec.reasons import Reason

__all__ = ["ModelFilesNotFound", "RegistryError"]


class RegistryError(SpecError):
    """A pipeline file, a pipeline name or a model the registry cannot use.

    A SpecError: the operator treats it as a permanent problem of the spec (Degraded, no retry storm)."""

    reason: ClassVar[Reason] = Reason.UNKNOWN_PIPELINE


class ModelFilesNotFound(RegistryError):
    """The model folder, or both of `config.json` and `model_index.json`, are missing.

    Unlike other registry errors this can heal by itself (the model cache is still being filled), so a
    caller may retry it with backoff instead of marking the spec wrong."""

    reason: ClassVar[Reason] = Reason.MODEL_FILES_NOT_FOUND
