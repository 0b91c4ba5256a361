"""CI time guard: a test module must not start its own serve of a topology a shared fixture serves.

Every vLLM start costs 35-50 s on an idle 2-core machine, much more on a loaded one, and CI time is the
project's limit. `servelib.SHARED_SERVES` lists the session fixtures that serve a topology's tiny model
once for the whole session; a module under tests/ or e2e/ that starts a serve of one of those topologies
itself fails here, unless it says why with a module-level string `OWN_SERVE = "<reason>"` (for instance:
settings no shared serve can have). Pure source reading (AST), no model load: it runs in `make test`'s
unit tier.

What counts as starting a serve:
- tests/: a call of `Serve(...)` (servelib's `omnikube serve` subprocess).
- e2e/: in a module marked `models` (a KWOK-only module applies pipelines whose pods never load a model),
  an `OmniPipeline` object (`"kind": "OmniPipeline"`, what every e2e module applies) or an `omnikube serve`
  command line.
The serve is of a shared topology when the module's code names it: an identifier (a fixture parameter such
as `tiny_chat_model`) or a string exactly equal to one of the entry's `names` (docstrings aside).
"""

from __future__ import annotations

import ast

import pytest
from servelib import REPO, SHARED_SERVES, SharedServe

OPT_OUT = "OWN_SERVE"
MIN_REASON_WORDS = 3
"""An opt-out's reason is a sentence a reviewer can check, not a placeholder."""
TIERS = ("tests", "e2e")


def _docstrings(tree: ast.Module) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.add(id(node.value))
    return out


def _strings(tree: ast.Module) -> list[str]:
    prose = _docstrings(tree)
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in prose
    ]


def _identifiers(tree: ast.Module) -> set[str]:
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return names


def _marked_models(tree: ast.Module) -> bool:
    """Whether the module's `pytestmark` (or any decorator) names `pytest.mark.models`."""
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == "models"
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
        for n in ast.walk(tree)
    )


def starts_serve(tree: ast.Module, tier: str) -> bool:
    """Whether a module of `tier` ("tests" or "e2e") starts a serve of its own (see the module docstring)."""
    if tier == "tests":
        return any(
            isinstance(n, ast.Call)
            and (
                (isinstance(n.func, ast.Name) and n.func.id == "Serve")
                or (isinstance(n.func, ast.Attribute) and n.func.attr == "Serve")
            )
            for n in ast.walk(tree)
        )
    if not _marked_models(tree):
        return False
    strings = _strings(tree)
    if "OmniPipeline" in strings or any("omnikube serve" in s for s in strings):
        return True
    # `[..., "omnikube", "serve", ...]` or `[sys.executable, "-m", "omni_runtime.cli", "serve", ...]`
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if "serve" in words and any(w.endswith(("omnikube", "omni_runtime.cli")) for w in words):
                return True
    return False


def opt_out(tree: ast.Module) -> str | None:
    """The module's `OWN_SERVE` reason (a module-level string), or None."""
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == OPT_OUT for t in targets):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
            return ""  # set, but not to a literal reason: a reviewer cannot read it here
    return None


def own_serve_problems(source: str, tier: str, shared: dict[str, SharedServe], where: str = "<module>") -> list[str]:
    """Why the module `source` (of `tier`) breaks the rule, one line per shared topology it serves itself
    without an opt-out, or an opt-out without a reason; [] when it keeps to it."""
    tree = ast.parse(source)
    if not starts_serve(tree, tier):
        return []
    names = _identifiers(tree) | set(_strings(tree))
    served = [topology for topology, s in shared.items() if s.tier == tier and names.intersection(s.names)]
    if not served:
        return []
    reason = opt_out(tree)
    if reason is not None and len(reason.split()) >= MIN_REASON_WORDS:
        return []
    if reason is not None:
        return [f"{where}: {OPT_OUT} must be a literal string giving the reason in words, not {reason!r}"]
    return [
        f"{where} starts its own serve of {topology!r}, which the session fixture `{shared[topology].fixture}` "
        f"already serves (servelib.SHARED_SERVES): use the fixture, or set a module-level {OPT_OUT} = "
        '"<why this module needs its own>"'
        for topology in served
    ]


def test_no_module_starts_its_own_serve_of_a_shared_topology() -> None:
    problems = []
    for tier in TIERS:
        for path in sorted((REPO / tier).glob("test_*.py")):
            where = str(path.relative_to(REPO))
            problems += own_serve_problems(path.read_text(), tier, SHARED_SERVES, where)
    assert problems == [], "\n".join(problems)


def test_every_shared_serve_is_a_session_fixture_of_its_tier() -> None:
    """The registry says what really exists: each fixture is defined, session-scoped, in its tier's conftest.py."""
    for topology, shared in SHARED_SERVES.items():
        assert shared.tier in TIERS, topology
        tree = ast.parse((REPO / shared.tier / "conftest.py").read_text())
        (fixture,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == shared.fixture]
        scopes = [
            k.value.value
            for d in fixture.decorator_list
            if isinstance(d, ast.Call)
            for k in d.keywords
            if k.arg == "scope" and isinstance(k.value, ast.Constant)
        ]
        assert scopes == ["session"], f"{shared.fixture} ({topology}) is not a session fixture"


# -- the guard itself, on fake modules ---------------------------------------------------------------

CHAT = {"text-chat": SHARED_SERVES["text-chat"]}
OWN_CHAT = '''
"""A module that serves the chat model itself."""
import pytest
from servelib import Serve

pytestmark = [pytest.mark.models]


@pytest.fixture(scope="module")
def serve(tiny_chat_model, tmp_path_factory):
    yield Serve({"model": str(tiny_chat_model), "name": "mine"}, tmp_path_factory.mktemp("x"))
'''


def test_a_module_starting_its_own_chat_serve_fails_the_guard() -> None:
    (problem,) = own_serve_problems(OWN_CHAT, "tests", CHAT, "tests/test_fake.py")
    assert "tests/test_fake.py starts its own serve of 'text-chat'" in problem
    assert "`chat_serve`" in problem and "OWN_SERVE" in problem


def test_a_module_with_a_reasoned_opt_out_passes_the_guard() -> None:
    source = OWN_CHAT + '\nOWN_SERVE = "it needs max_model_len 64, which would starve the shared serve"\n'
    assert own_serve_problems(source, "tests", CHAT) == []


def test_an_opt_out_without_a_reason_fails_the_guard() -> None:
    for value in ('""', '"todo"', "REASON"):
        (problem,) = own_serve_problems(OWN_CHAT + f"\nOWN_SERVE = {value}\n", "tests", CHAT)
        assert "OWN_SERVE must be a literal string giving the reason" in problem


def test_modules_using_the_fixture_or_serving_another_topology_pass_the_guard() -> None:
    uses_fixture = '''
def test_chat(chat_serve, tiny_chat_model):
    """Mentions Serve( and tiny-qwen2-chat only in prose."""
'''
    other = OWN_CHAT.replace("tiny_chat_model", "tiny_flux_model")
    assert own_serve_problems(uses_fixture, "tests", CHAT) == []
    assert own_serve_problems(other, "tests", CHAT) == []


@pytest.mark.parametrize(
    "start",
    [
        'apply(cluster, ns, {"kind": "OmniPipeline", "spec": {"pipeline": "text-chat"}})',
        'subprocess.Popen(["omnikube", "serve", "--pipeline", "text-chat"])',
        'subprocess.Popen([sys.executable, "-m", "omni_runtime.cli", "serve", "text-chat.yaml", "text-chat"])',
    ],
    ids=["OmniPipeline", "omnikube serve", "omni_runtime.cli serve"],
)
def test_an_e2e_module_running_a_shared_topology_fails_the_guard_unless_kwok_only(start: str) -> None:
    """e2e shared serves live in e2e/conftest.py; a fake entry stands for one here."""
    shared = {"text-chat": SharedServe("chat_pipeline", "e2e", ("text-chat",))}
    models = f"import pytest\npytestmark = [pytest.mark.cluster, pytest.mark.models]\n\ndef test_x():\n    {start}\n"
    (problem,) = own_serve_problems(models, "e2e", shared, "e2e/test_fake.py")
    assert "e2e/test_fake.py starts its own serve of 'text-chat'" in problem and "`chat_pipeline`" in problem
    # KWOK only: its pods never load a model, so it starts no serve
    assert own_serve_problems(models.replace(", pytest.mark.models", ""), "e2e", shared) == []
    # a tests/ entry does not bind e2e modules: a local serve cannot stand in for a pipeline in the cluster
    assert own_serve_problems(models, "e2e", CHAT) == []


# -- the order of destructive tests (conftest.py's collection hook) -----------------------------------


class _Item:
    """What the hook reads of a collected test: its fixtures and its `destructive` mark."""

    def __init__(self, name: str, fixtures: tuple[str, ...] = (), mark: pytest.MarkDecorator | None = None) -> None:
        self.name, self.fixturenames, self._mark = name, list(fixtures), mark

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return self._mark.mark if self._mark is not None and name == "destructive" else None


def test_destructive_tests_run_after_the_last_reader_of_their_serve_and_the_last_marked_at_the_end(request) -> None:
    (tests_conftest,) = [
        p
        for p in request.config.pluginmanager.get_plugins()
        if getattr(p, "__file__", None) == str(REPO / "tests" / "conftest.py")
    ]
    kill, drain = pytest.mark.destructive, pytest.mark.destructive(last=True)
    items = [
        _Item("chat-read-1", ("chat_serve",)),
        _Item("router-sigterm", ("chat_serve",), drain),
        _Item("replica-kill", ("chat_serve",), kill),
        _Item("unrelated-1"),
        _Item("chat-read-2", ("chat_serve",)),
        _Item("own-serve-kill", ("tmp_path",), kill),  # its own serve: stays where it is
        _Item("unrelated-2"),
    ]
    tests_conftest.pytest_collection_modifyitems(items)
    assert [i.name for i in items] == [
        "chat-read-1", "unrelated-1", "chat-read-2", "replica-kill", "router-sigterm", "own-serve-kill",
        "unrelated-2",
    ]  # fmt: skip
    alone = [_Item("router-sigterm", ("chat_serve",), drain), _Item("stage-sigterm", ("chat_serve",), kill)]
    tests_conftest.pytest_collection_modifyitems(alone)  # a module run alone: no reader collected
    assert [i.name for i in alone] == ["stage-sigterm", "router-sigterm"]
