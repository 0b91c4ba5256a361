"""Fixtures for the stage, router and serve tests; the helpers they use are in servelib.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from servelib import (
    CHAT_DRAIN_TIMEOUT_S,
    SHARED_SERVES,
    Serve,
    chat_serve_spec,
    listening_only_on_loopback,
    pid_alive,
    process_exists,
    serve_tree,
    shm_segments,
    tiny_model,
)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real `mooncake_master` (and its HTTP metadata server) on free loopback ports, one per test module;
    checked to listen on 127.0.0.1 only, and to leave no process behind once stopped."""
    from omni_runtime.connectors.mooncake_master import MooncakeMaster, free_port

    master = MooncakeMaster(
        rpc_port=free_port(), metadata_port=free_port(), log_dir=str(tmp_path_factory.mktemp("mooncake"))
    )
    with master:
        for port in (master.rpc_port, master.metadata_port, master.metrics_port):
            assert listening_only_on_loopback(port)
        yield master
        pids = master.pids
    assert master.master is None
    for pid in pids:
        assert not process_exists(pid), f"mooncake process {pid} still running after stop"


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


@pytest.fixture(scope="session")
def tiny_z_image_model() -> Path:
    return tiny_model("tiny-z-image")


@pytest.fixture(scope="session")
def tiny_bagel_model() -> Path:
    return tiny_model("tiny-bagel")


# -- shared serves and the order of the tests that break them --------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "destructive(last=False): kills or drains a process of a shared serve (servelib.SHARED_SERVES); "
        "runs after every other test of that serve, and with last=True after every destructive one too (the "
        "router's SIGTERM: while the router drains and the launcher restarts it, nothing else can use the serve)",
    )


def _destructive_rank(item: pytest.Item) -> int:
    """0 for a test that leaves its serve as it found it, 1 for a destructive one, 2 for one that must come last."""
    mark = item.get_closest_marker("destructive")
    if mark is None:
        return 0
    return 2 if mark.kwargs.get("last") else 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Moves each destructive test of a shared serve to just after the last test that only reads that serve
    (not to the end of the session: the serve's processes are then gone sooner, before the heavy modules
    that follow). Among the moved ones, collection order, with the `last` ones last."""
    shared = {s.fixture for s in SHARED_SERVES.values()}

    def serves(item: pytest.Item) -> list[str]:
        return sorted(shared.intersection(getattr(item, "fixturenames", ())))

    moved = [i for i in items if _destructive_rank(i) and serves(i)]
    if not moved:
        return
    order = {id(item): n for n, item in enumerate(items)}
    stay = [i for i in items if not (_destructive_rank(i) and serves(i))]
    groups: dict[str, list[pytest.Item]] = {}
    for item in moved:
        groups.setdefault(serves(item)[0], []).append(item)
    anchors = []
    for fixture, group in groups.items():
        readers = [n for n, i in enumerate(stay) if fixture in getattr(i, "fixturenames", ())]
        # with no reader collected (a module run alone, -k), where the first of them was
        before = sum(1 for i in stay if order[id(i)] < order[id(group[0])])
        anchors.append((readers[-1] + 1 if readers else before, sorted(group, key=_destructive_rank)))
    for at, group in sorted(anchors, key=lambda a: a[0], reverse=True):
        stay[at:at] = group
    items[:] = stay


@pytest.fixture(scope="session")
def chat_serve(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """`omnikube serve` of the text-chat pipeline on the tiny Qwen2 model for the whole session
    (servelib.chat_serve_spec: 2 replicas, CHAT_MAX_MODEL_LEN, the hermes tool parser, CHAT_LIMITS,
    `--drain-timeout CHAT_DRAIN_TIMEOUT_S`), shared by test_serve_chat, test_serve_drain, test_router_fuzz
    and test_openai_conformance. Tests that kill or drain its processes are marked `destructive` and run
    after its readers. Afterwards: it stops with code 0, leaves no process and no shm segment behind."""
    run = Serve(
        chat_serve_spec(tiny_chat_model),
        tmp_path_factory.mktemp("chat-serve"),
        args=("--drain-timeout", str(CHAT_DRAIN_TIMEOUT_S)),
    )
    tree: set[int] = set()
    try:
        yield run
        tree = serve_tree(run)  # now, with the processes the launcher restarted during the session
    finally:
        code = run.stop(timeout=120)
    assert code == 0, run.log.read_text(errors="replace")[-3000:]
    assert [pid for pid in tree if pid_alive(pid)] == [], "processes left behind after serve stopped"
    assert shm_segments(run.name) == []


@pytest.fixture(scope="session")
def tiny_glm_image_model() -> Path:
    return tiny_model("tiny-glm-image")
