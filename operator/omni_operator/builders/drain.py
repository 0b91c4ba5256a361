"""How the stage and router pods stop: the drain budget inside terminationGracePeriodSeconds.

The kubelet gives a stopping pod `grace` seconds in all: its preStop hook, then SIGTERM, then SIGKILL.
The process drains after SIGTERM (`--drain-timeout`): no new work, running work finishes, what outlives
the budget fails with a retriable 503. The budget leaves a margin for stopping itself (an engine's
shutdown, the last responses reaching their clients) so that SIGKILL never cuts a drain short.

Only the router has a preStop sleep: clients reach it through a Service, whose endpoints (kube-proxy,
load balancers) drop a terminating pod a moment after it starts terminating, so it keeps serving that
moment before it stops accepting connections. Stage pods need none: their only client, the router,
hears of the drain on the protocol as SIGTERM arrives (and from the EndpointSlice), and a stage still
runs a work a router sent before it heard.
"""

from __future__ import annotations

__all__ = ["ROUTER_PRE_STOP_S", "drain_timeout", "router_pre_stop"]

ROUTER_PRE_STOP_S = 5
"""Seconds the router still serves after it starts terminating, while the Service's endpoints converge."""
STOP_MARGIN_S = 5
"""At most this much of the grace period is kept for stopping after the drain."""


def router_pre_stop(grace: int) -> int:
    """The router's preStop sleep in a pod with `grace` seconds: 5, or a quarter of a short grace."""
    return min(ROUTER_PRE_STOP_S, grace // 4)


def drain_timeout(grace: int, pre_stop: int = 0) -> int:
    """`--drain-timeout` of a process in a pod with `grace` seconds of which a preStop hook takes
    `pre_stop`: what is left, less a quarter of it (5 s at most) for stopping; at least 1."""
    left = max(grace - pre_stop, 1)
    return max(left - min(STOP_MARGIN_S, left // 4), 1)
