"""The pod runner: real processes for the pods of the nodes it owns (see README.md)."""

from podrunner.containers import Backoff
from podrunner.logs import log_path, read_log
from podrunner.node import RUNNER_LABEL, RUNNER_TAINT, NodeConfig
from podrunner.runner import PodRunner

__all__ = ["Backoff", "NodeConfig", "PodRunner", "RUNNER_LABEL", "RUNNER_TAINT", "log_path", "read_log"]
