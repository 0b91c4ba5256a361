"""What authenticating every stage-protocol message costs, against the same messages unauthenticated.

    .venv/bin/python bench/stage_auth.py [--repeats 15] [--loops 2000]

Per message kind (a Ping, a Submit of a chat prompt, an Output carrying a shm handle, an Output with a
1 MiB inline payload), in the same run and in shuffled order per round:
  - baseline: `protocol.encode` + `protocol.decode` (protocol version 1 did just this);
  - ours: `encode` + `Channel.seal` + `Channel.open` + `decode` (HMAC-SHA256 over every frame, session
    and counter checks), between a router channel and the stage channel its Hello opened.
Prints the median time per message of each, the added microseconds, and ours/baseline. No sockets: the
ZeroMQ send/recv both variants pay is left out, so the ratio is the upper bound of what auth adds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from omni_runtime.connectors.shm import ShmHandle
from omni_runtime.wire import protocol as P
from omni_runtime.wire.auth import Channel, PipelineKey, open_hello


def _channels() -> tuple[Channel, Channel]:
    key = PipelineKey.generate()
    router = Channel(key, "router")
    stage, _ = open_hello(key, router.seal(P.encode(P.Hello())))
    router.open(stage.seal(P.encode(P.Welcome(stage="s"))))
    return router, stage


def _messages() -> dict[str, tuple[P.Message, dict | None]]:
    handle = ShmHandle(
        key="req.primary.0", source="thinker", target="talker", nbytes=4096,
        segment="omnikube-p-thinker_r0-p1234-0123456789abcdef", generation=3, layout=[120, 4096],
    )  # fmt: skip
    submit = P.Submit(id="r1.0.llm.primary", request_id="r1", stage="llm", data=True, final=True, stream=True)
    return {
        "ping": (P.Ping(nonce=7, sent_at=1.0), None),
        "submit (chat prompt)": (submit, {"messages": [{"role": "user", "content": "Describe a red fox. " * 8}]}),
        "output (shm handle)": (
            P.Output(id="r1.0.llm.primary", seq=3, handles=[P.Input(source="thinker", handle=handle)]),
            None,
        ),  # fmt: skip
        "output (1 MiB inline)": (
            P.Output(id="r1.0.dit.primary", seq=1, data=True),
            {"image": np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8)},
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--loops", type=int, default=2000, help="messages per timing (1 MiB: a tenth)")
    args = parser.parse_args()
    router, stage = _channels()

    def plain(message: P.Message, payload: dict | None) -> None:
        P.decode([bytes(f) if isinstance(f, bytes) else f for f in P.encode(message, payload)])

    def authed(message: P.Message, payload: dict | None) -> None:
        P.decode(stage.open(router.seal(P.encode(message, payload))))

    print(f"{'message':24} {'baseline us':>12} {'ours us':>10} {'added us':>9} {'ours/base':>10}")
    for name, (message, payload) in _messages().items():
        loops = max(1, args.loops // 10) if payload and "image" in payload else args.loops
        variants: dict[str, Callable[[P.Message, dict | None], None]] = {"base": plain, "ours": authed}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.repeats):
            order = list(variants)
            random.shuffle(order)
            for variant in order:
                fn = variants[variant]
                started = time.perf_counter()
                for _ in range(loops):
                    fn(message, payload)
                times[variant].append((time.perf_counter() - started) / loops * 1e6)
        base, ours = statistics.median(times["base"]), statistics.median(times["ours"])
        print(f"{name:24} {base:12.1f} {ours:10.1f} {ours - base:9.1f} {ours / base:10.2f}")


if __name__ == "__main__":
    main()
