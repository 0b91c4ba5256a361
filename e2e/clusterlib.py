"""Helpers the cluster-tier tests share (kept out of conftest.py, whose module name tests/ also uses)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def kubectl_json(cluster: Any, *args: str) -> dict:
    """`kubectl <args> -o json`, parsed."""
    return json.loads(cluster.kubectl(*args, "-o", "json").stdout)
