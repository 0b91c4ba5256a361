"""A stage starts the connectors its edges need before it calls itself ready.

Real Mooncake (master, transfer engine) and the real stage server; the engine is the echo stand-in of
tests/servelib.py because what is checked happens before any model would load. The last test runs the
real `omnikube stage` process, started with the command line its settings model writes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from servelib import EchoEngine, http_get

from omni_runtime.connectors.mooncake_master import MooncakeMaster, free_port
from omni_runtime.registry import get_pipeline
from omni_runtime.spec import ConnectorsSpec, EdgeOverride, ResolvedPipeline, resolve_pipeline
from omni_runtime.spec.reasons import Reason
from omni_runtime.stage.connectors import ConnectorSettings
from omni_runtime.stage.main import connector_settings
from omni_runtime.stage.server import StageServer
from omni_runtime.stage.settings import StageSettings
from omni_runtime.stage.termination import Termination
from omni_runtime.wire.auth import PipelineKey

pytestmark = pytest.mark.timeout(240)

SIZES = {"global_segment_size": 64 * 1024**2, "local_buffer_size": 16 * 1024**2}


def mooncake_pipeline(mode: str) -> ResolvedPipeline:
    """prompt-enhanced-t2i with enhancer -> dit over mooncake, its master on free loopback ports."""
    connectors = ConnectorsSpec.model_validate(
        {"mooncake": {**SIZES, "mode": mode, "master_port": free_port(), "metadata_port": free_port()}}
    )
    resolved = resolve_pipeline(
        get_pipeline("prompt-enhanced-t2i"),
        name=f"startup-{mode}",
        model="/nonexistent",
        edges=[EdgeOverride(**{"from": "enhancer", "to": "dit", "connector": "mooncake"})],
        connectors=connectors,
    )
    resolved.mooncake_master_host = "127.0.0.1"
    return resolved


def master_for(resolved: ResolvedPipeline, log_dir: Path) -> MooncakeMaster:
    mc = resolved.topology.connectors.mooncake
    return MooncakeMaster(rpc_port=mc.master_port, metadata_port=mc.metadata_port, log_dir=str(log_dir))


@pytest.mark.parametrize("mode", ["p2p", "store"])
async def test_a_stage_is_not_ready_until_the_mooncake_master_answers(mode: str, tmp_path: Path) -> None:
    resolved = mooncake_pipeline(mode)
    settings = ConnectorSettings(owner="enhancer-r0", start_timeout_s=120)
    server = StageServer(
        resolved, "enhancer", engine=EchoEngine(resolved, resolved.topology.stage("enhancer")),
        key=PipelineKey.generate(), port=0, http_port=0, connectors=settings,
    )  # fmt: skip
    await server.start()
    master = master_for(resolved, tmp_path)
    try:
        await asyncio.sleep(3)  # at least one attempt failed: no master yet
        assert not server.ready
        code, body = await asyncio.to_thread(http_get, f"http://127.0.0.1:{server.http_port}/readyz")
        assert code == 503 and json.loads(body)["status"] == "connectors starting"
        await master.astart()
        deadline = time.monotonic() + 60
        while not server.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert server.ready, server.phase
        code, _ = await asyncio.to_thread(http_get, f"http://127.0.0.1:{server.http_port}/readyz")
        assert code == 200
    finally:
        await server.stop()
        await master.astop()


async def test_a_stage_gives_up_after_its_connector_timeout_naming_the_address() -> None:
    resolved = mooncake_pipeline("p2p")  # no master is ever started
    server = StageServer(
        resolved, "dit", engine=EchoEngine(resolved, resolved.topology.stage("dit")), key=PipelineKey.generate(),
        port=0, http_port=None,
        connectors=ConnectorSettings(owner="dit-r0", start_timeout_s=3),
    )  # fmt: skip
    await server.start()
    try:
        with pytest.raises(Exception, match="did not start") as exc:
            await asyncio.wait_for(server.serve_forever(), 60)
        mc = resolved.topology.connectors.mooncake
        assert f"http://127.0.0.1:{mc.metadata_port}/metadata" in str(exc.value)
        assert "enhancer->dit" in str(exc.value)
        assert not server.ready and server.phase == "connector unavailable"
    finally:
        await server.stop()


def test_the_stage_process_exits_with_a_typed_termination_message(tmp_path: Path) -> None:
    resolved = mooncake_pipeline("store")
    resolved.mooncake_master_host = "omnikube-no-such-master.invalid"  # what a missing Service looks like
    config = tmp_path / "resolved.json"
    config.write_text(resolved.model_dump_json(by_alias=True))
    termination = tmp_path / "termination-log"
    termination.write_text("")  # the kubelet creates the file; the stage only writes into it
    key = tmp_path / "pipeline-key"
    PipelineKey.write_new(key)
    settings = StageSettings(
        config=str(config), pipeline_key_file=str(key), stage="enhancer", host="127.0.0.1", port=free_port(),
        http_port=free_port(), connector_timeout=3, termination_log=str(termination),
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "omni_runtime.cli", settings.command, *settings.to_argv()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    told = Termination.parse(termination.read_text())
    assert told is not None, termination.read_text()
    assert told.reason is Reason.CONNECTOR_UNAVAILABLE
    mc = resolved.topology.connectors.mooncake
    assert f"omnikube-no-such-master.invalid:{mc.master_port}" in told.message
    assert "enhancer->dit" in told.message


def test_the_stage_takes_its_connector_timeout_from_the_pipeline_unless_its_flag_says() -> None:
    resolved = mooncake_pipeline("p2p")
    resolved.topology.connectors.start_timeout_seconds = 15  # the OmniPipeline's connectors.startTimeoutSeconds
    settings = StageSettings(config="r.json", pipeline_key_file="k", stage="dit")
    assert connector_settings(settings, resolved, "r0").start_timeout_s == 15
    flagged = settings.model_copy(update={"connector_timeout": 2.5})
    assert connector_settings(flagged, resolved, "r0").start_timeout_s == 2.5


def test_without_a_termination_file_the_stage_writes_none(tmp_path: Path) -> None:
    told = Termination(reason=Reason.CONNECTOR_UNAVAILABLE, message="m")
    assert told.write(str(tmp_path / "absent")) is False
    assert not (tmp_path / "absent").exists()
