"""Load for the cluster tier: client threads sending requests through a router while a test changes
the pipeline under them (rolls, autoscaling), keeping every outcome."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType

import httpx
import openai

__all__ = ["RouterService", "SteadyLoad"]


class RouterService:
    """What a Service's endpoints give a client (kube-proxy has no stand-in here), as a callable: the base URL
    (`.../v1`) of a ready router pod that is not terminating, followed while the router rolls. `router_pods`
    lists the pipeline's router pods."""

    def __init__(self, router_pods: Callable[[], list[dict]]) -> None:
        self.router_pods = router_pods
        self._url = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def _look(self) -> None:
        ready = [
            p for p in self.router_pods()
            if not p["metadata"].get("deletionTimestamp") and p["status"].get("podIP")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
        ]  # fmt: skip
        if ready:
            self._url = f"http://{ready[0]['status']['podIP']}:8000/v1"

    def _follow(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # the API server is busy: the last URL still holds
                self._look()
            time.sleep(0.3)

    def __call__(self) -> str:
        return self._url

    def __enter__(self) -> RouterService:
        self._look()
        assert self._url, "no ready router pod"
        self._thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(10)


class SteadyLoad:
    """Client threads sending requests back to back through the router until `stop()`; every outcome
    is kept. Each request opens its own connection (a client behind a Service gets a new one to the
    pod the Service picks); `max_retries=0`, so nothing is retried behind the test's back."""

    def __init__(self, base_url: Callable[[], str], calls: list[Callable[[openai.OpenAI], None]]) -> None:
        self.base_url = base_url
        self.calls = calls
        self.outcomes: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(c,), daemon=True) for c in calls]

    def _loop(self, call: Callable[[openai.OpenAI], None]) -> None:
        while not self._stop.is_set():
            url = self.base_url()
            http = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=120)
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=http)
            try:
                call(client)
                self.outcomes.append(("ok", ""))
            except openai.APIStatusError as exc:
                self.outcomes.append((str(exc.status_code), f"{url}: {exc.message}"))
            except Exception as exc:  # noqa: BLE001 - every failure counts, whatever its kind
                self.outcomes.append((type(exc).__name__, f"{url}: {exc}"))
            finally:
                client.close()

    def start(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def ok(self) -> int:
        return sum(1 for kind, _ in self.outcomes if kind == "ok")

    def stop(self) -> list[tuple[str, str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(180)
        return [o for o in self.outcomes if o[0] != "ok"]
