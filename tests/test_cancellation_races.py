"""Cancellation at the awkward moments: every payload is released however a request ends.

Two races, each forced here at the moment that used to lose a payload (found by a mixed load with
cancellations leaving enhancer shm payloads held):

- The router: a stage's output carrying handles has reached the request's queue but the request is
  cancelled (client gone, timeout) before it was looked at. Nothing else knows of those handles.
- The stage server: an `Abort` read right behind its `Submit`, before the new work's task ever ran. A
  task cancelled before its first step skips its body, cleanup included: the work stayed listed as
  running forever and never released its input handles.

Real stage servers (EchoEngine, see its docstring), real ZeroMQ and real shm connectors. Each race is
forced at its moment by a small seam, said where it is used.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from servelib import busy_shm_segments, echo_cluster, echo_pipeline, until

from omni_runtime.connectors.shm import ShmConnector
from omni_runtime.router.client import ReplicaClient
from omni_runtime.router.orchestrator import Orchestrator, PipelineRequest
from omni_runtime.router.plan import plan_request
from omni_runtime.spec import CompanionSpec, EdgeSpec, PipelineSpec, StageSpec
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import Channel

pytestmark = pytest.mark.timeout(60)


def enhanced_topology() -> PipelineSpec:
    return PipelineSpec(
        name="race",
        stages=[
            StageSpec(name="a", kind="ar", companions=[CompanionSpec(role="cfg_text", negative_prompt="ugly dark")]),
            StageSpec(name="b", kind="ar", final_output=True),
        ],
        edges=[EdgeSpec(**{"from": "a", "to": "b", "connector": "shm", "input_processor": "ar_text_to_prompt"})],
    )


async def test_a_request_cancelled_with_handles_still_queued_releases_them(monkeypatch) -> None:
    """The seam: the router's per-work message sink (what `ReplicaClient` calls for each message) is
    wrapped so that the request is cancelled right after stage `a`'s handles were queued for it, in the
    same turn of the event loop, before the request's loop could look at them."""
    pipeline = echo_pipeline(enhanced_topology(), name="race-queued")
    async with echo_cluster(pipeline) as cluster:
        orchestrator = Orchestrator(pipeline, cluster.pool)
        run: asyncio.Task | None = None
        cancelled_with: list[int] = []
        submit = ReplicaClient.submit

        def submit_then_cancel_on_handles(self, message, payload, sink):
            def sink_and_cancel(msg, rest, lost):
                sink(msg, rest, lost)
                if isinstance(msg, P.Output) and msg.handles and run is not None and not run.done():
                    cancelled_with.append(len(msg.handles))
                    run.cancel()

            submit(self, message, payload, sink_and_cancel if self.stage == "a" else sink)

        monkeypatch.setattr(ReplicaClient, "submit", submit_then_cancel_on_handles)
        request = PipelineRequest(
            request_id="req-1",
            plan=plan_request(pipeline.topology, ["text"]),
            entry={"a": {"prompt": "a red fox"}},
        )
        run = asyncio.create_task(orchestrator.run(request, lambda event: None))
        with pytest.raises(asyncio.CancelledError):
            await run
        assert cancelled_with, "the request was not cancelled with a handle queued"
        await until(lambda: all(not s.works for ss in cluster.servers.values() for s in ss), "works still running")
        await until(lambda: busy_shm_segments(pipeline.name) == [], "stage a's payloads were never released")
        assert cluster.engines["b"][0].seen == []  # the cancelled request never reached stage b


async def test_an_abort_right_behind_its_submit_closes_the_work_and_releases_its_inputs() -> None:
    """The seam: the test speaks the stage protocol itself over a real DEALER socket and sends the
    Submit and the Abort back to back, then holds the event loop a moment (a blocking sleep) so both are
    in the stage's socket before it reads either, as under load."""
    pipeline = echo_pipeline(enhanced_topology(), name="race-abort")
    async with echo_cluster(pipeline) as cluster:
        stage_b = cluster.servers["b"][0]
        with ShmConnector(pipeline=pipeline.name, owner="test", pool_max_bytes=0) as shm:
            handle = await shm.put("a", "b", "req-2.primary.0", {"text": "a red fox"})
            assert busy_shm_segments(pipeline.name) != []
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{stage_b.port}")
            try:
                item = P.Input(source="a", role="primary", seq=0, last=True, handle=handle)
                submit = P.Submit(
                    id="req-2.0.b.primary", request_id="req-2", stage="b", role="primary", inputs=[item],
                    input_processor="ar_text_to_prompt", final=True,
                )  # fmt: skip
                channel = Channel(cluster.key, "router")  # the pipeline's router: it holds the key
                await sock.send_multipart(channel.seal(P.encode(P.Hello())))
                welcome, _ = P.decode(channel.open(await asyncio.wait_for(sock.recv_multipart(), 10)))
                assert isinstance(welcome, P.Welcome)
                await sock.send_multipart(channel.seal(P.encode(submit)))
                await sock.send_multipart(channel.seal(P.encode(P.Abort(id=submit.id, reason="client gone"))))
                time.sleep(0.3)  # keep the stage from reading the Submit alone
                await until(lambda: submit.id not in stage_b.works, "the aborted work is still listed as running")
                await until(lambda: busy_shm_segments(pipeline.name) == [], "its input payload was never released")
            finally:
                sock.close(0)
                ctx.term()
