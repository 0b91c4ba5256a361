"""Fixtures for the stage, router and serve tests; the helpers they use are in servelib.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from servelib import tiny_model


@pytest.fixture(scope="session")
def tiny_chat_model() -> Path:
    return tiny_model("tiny-qwen2-chat")


@pytest.fixture(scope="session")
def tiny_t2i_model() -> Path:
    return tiny_model("tiny-prompt-enhanced-t2i")


@pytest.fixture(scope="session")
def tiny_sd3_model() -> Path:
    return tiny_model("tiny-sd3")


@pytest.fixture(scope="session")
def tiny_sd3_img2img_model() -> Path:
    return tiny_model("tiny-sd3-img2img")


@pytest.fixture(scope="session")
def tiny_wan_t2v_model() -> Path:
    return tiny_model("tiny-wan2-2-t2v")


@pytest.fixture(scope="session")
def tiny_wan_i2v_model() -> Path:
    return tiny_model("tiny-wan2-2-i2v")


@pytest.fixture(scope="session")
def tiny_flux_model() -> Path:
    return tiny_model("tiny-flux")


@pytest.fixture(scope="session")
def tiny_qwen_image_model() -> Path:
    return tiny_model("tiny-qwen-image")


@pytest.fixture(scope="session")
def tiny_qwen_image_edit_model() -> Path:
    return tiny_model("tiny-qwen-image-edit")
