"""`make test`'s test run: the suite's tiers as lanes, side by side where they do not compete, then a summary.

The machine has two cores. What decides the suite's time is CPU-bound work (model loads, requests on tiny
models) and wait-bound work (the KWOK-only cluster modules: polls on a real API server, operator start-ups,
liveness windows). So:

    control plane and Prometheus builds (Go)     <- the lanes wait for them (cold: minutes, the machine to themselves
                                                    but for the venv install and the lint); warm: instant
    sequence 1: lane "unit", then "served" (tests/)                | side by side: "cluster" mostly waits (polls
    sequence 2: lane "cluster", then "e2e", then "demo" (e2e/)     | on a real API server), and no lane keeps two
    sequence 3: lane "served-early", then "served-late" (tests/)   | cores busy (tiny models: mostly one Python
                                                                     thread per process); sequence 3 takes served
                                                                     modules that share no serve, so the cores do
                                                                     not idle while "unit" and "cluster" run, and
                                                                     the three sequences end together

Why the lanes cannot interfere: each pytest process runs its own control plane (e2e/conftest.py `cluster`
starts one per session in its own folder, on free ports), so no cluster-wide object (CRDs, KEDA's
ScaledObject CRD, APIServices) is shared between lanes. tests/ (unit, served) starts no pod runner and no
cluster; the pod runners (cluster, e2e, demo: host-wide state, bridges, network namespaces, their pods'
processes) run in one sequence, one lane at a time, and each takes its bridge's /24 under a host-wide lock.
"demo" runs `make demo`, whose cluster and pod runner live in the checkout's .omnikube/: only one lane runs
it. Each lane has its own pytest basetemp and no cache provider; model caches are shared and built under locks.

The KEDA build (the cluster and e2e lanes need it) runs in the background beside the control plane's, so the
lanes wait for it as well; cold, it ends first. Each lane writes its output to `.omnikube/test-logs/<lane>.log`
and its results to `.omnikube/junit/<lane>.xml`; the first sequence (unit, served) also prints to the terminal.
A lane that fails prints its log at the end, and the run exits non-zero. The summary gives tests and seconds per
lane and the 20 slowest tests (setup and teardown included, so a fixture's serve start counts in its first test).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / ".omnikube"
PY = sys.executable


@dataclass
class Lane:
    """One pytest process: a tier of the suite."""

    name: str
    args: list[str]
    """pytest arguments selecting the tier's tests."""
    tier: str = ""
    """The tier it belongs to when a tier is split over several lanes (`--lanes <tier>` runs them all)."""
    live: bool = False
    """Stream its output to the terminal as well as to its log."""
    needs: tuple[str, ...] = ()
    """Build scripts (with arguments) whose output it needs; its phase waits for them before any lane starts, so on
    a cold machine the Go builds have the cores to themselves (each script holds a lock while it builds, and is a
    no-op once cached)."""
    returncode: int | None = None
    seconds: float = 0.0

    @property
    def log(self) -> Path:
        return OUT / "test-logs" / f"{self.name}.log"

    @property
    def junit(self) -> Path:
        return OUT / "junit" / f"{self.name}.xml"

    def run(self, basetemp: Path, extra: list[str]) -> int:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.junit.parent.mkdir(parents=True, exist_ok=True)
        self.junit.unlink(missing_ok=True)
        cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp / self.name}",
               f"--junitxml={self.junit}", "-o", "junit_family=xunit2", *self.args, *extra]  # fmt: skip
        started = time.monotonic()
        with open(self.log, "wb") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the lane's own prints too, as they happen
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
            assert proc.stdout is not None
            # read1, not readline: pytest -q writes a line of progress dots only as tests end, minutes apart
            for chunk in iter(lambda: proc.stdout.read1(65536), b""):
                log.write(chunk)
                log.flush()  # the log shows a lane's progress as it goes (a hung lane's log held only its command)
                if self.live:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
            self.returncode = proc.wait()
        self.seconds = time.monotonic() - started
        print(f"run_tests: lane {self.name} exited {self.returncode} after {self.seconds:.0f} s", flush=True)
        return self.returncode


@dataclass
class Phase:
    """Sequences of lanes that run side by side (the lanes of one sequence one after the other); the next phase
    starts when all have ended."""

    lanes: list[list[Lane]]

    @property
    def needs(self) -> list[str]:
        """What the first lane of each sequence needs: built before the phase starts, the machine to itself. A
        later lane of a sequence waits for its own needs when its turn comes (built in the background by then)."""
        return list(dict.fromkeys(need for seq in self.lanes for need in seq[0].needs))


def wait_for_build(script: str) -> None:
    started = time.monotonic()
    subprocess.run(["bash", str(REPO / script.split()[0]), *script.split()[1:]], check=True,
                   cwd=REPO, stdout=subprocess.DEVNULL)  # fmt: skip
    waited = time.monotonic() - started
    if waited > 1:
        print(f"run_tests: waited {waited:.0f} s for {script}", flush=True)


SERVED_BESIDE: dict[str, tuple[str, ...]] = {
    "served-early": (
        "tests/test_topology_defaults.py",
        "tests/test_tiny_models.py",
        "tests/test_tiny_omni_models.py",
        "tests/test_diffusion_parallel.py",
    ),
    "served-late": (
        "tests/test_serve_t2i.py",
        "tests/test_serve_bagel.py",
        "tests/test_kv_export.py",
        "tests/test_bagel.py",
        "tests/test_glm_image.py",
    ),
}
"""Served modules of sequence 3, by lane; the "served" lane runs the rest. None of them uses a shared session serve
(each starts its own engines or serves), so moving them starts nothing twice. Measured on a warm fresh clone
(two sequences then): unit+served 1946 s, cluster+e2e+served-late+demo 1872 s, with the cores 26-40 % idle
during the first five minutes; these modules took 266 s (early) and 200 s (late) of that. The BAGEL modules (one
vLLM start each for the serve and the KV export) went to "served-late": on the cold run of 2026-12-02 sequence 3
(654 + 478 s) ended some 750 s before sequence 1 (381 + 1511 s); GLM-Image's (~40 s) went there too. On the
warm run of 4b31c52 sequence 1 (271 + 1352 s) still ended 700 s after sequence 3 (265 + 661 s), so the
multi-rank diffusion module (288 s of "served", its own ranks per test) went to "served-early"."""


def lanes_of(selection: str) -> list[Phase]:
    unit = Lane("unit", ["tests", "-m", "not models"], live=True)
    ignored = [f"--ignore={module}" for modules in SERVED_BESIDE.values() for module in modules]
    served = Lane("served", ["tests", "-m", "models", *ignored], live=True, tier="served")
    served_early, served_late = (
        Lane(name, [*modules, "-m", "models"], tier="served") for name, modules in SERVED_BESIDE.items()
    )
    control_plane, prometheus, keda = (
        "e2e/cluster/build.sh",
        "e2e/cluster/addons/build.sh prometheus",
        "e2e/cluster/addons/build.sh keda",
    )
    # "cluster" runs Prometheus over the chart's alert rules (test_helm_chart) and installs KEDA (test_keda_cluster):
    # built before, not inside a test (cold, KEDA's build ends before the control plane's: they build side by side)
    cluster = Lane("cluster", ["e2e", "-m", "not models and not demo"], needs=(control_plane, prometheus, keda))
    e2e = Lane("e2e", ["e2e", "-m", "models and not demo"], needs=(control_plane, prometheus, keda))
    demo = Lane("demo", ["e2e", "-m", "demo"], needs=(control_plane,))
    phases = [Phase([[unit, served], [cluster, e2e, demo], [served_early, served_late]])]
    if selection == "all":
        return phases
    wanted = set(selection.split(","))
    out = []
    for phase in phases:
        kept = [[lane for lane in seq if wanted & {lane.name, lane.tier}] for seq in phase.lanes]
        kept = [seq for seq in kept if seq]
        if kept:
            out.append(Phase(kept))
    return out


def run_sequence(seq: list[Lane], basetemp: Path, extra: list[str]) -> None:
    for lane in seq:
        for script in lane.needs:
            wait_for_build(script)
        lane.run(basetemp, extra)


# -- the summary -----------------------------------------------------------------------------------------------


@dataclass
class Tally:
    tests: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0


def read_junit(path: Path) -> list[tuple[str, float, str]]:
    """(test id, seconds, outcome) of every test case in a junit file."""
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        out.append((name, float(case.get("time") or 0), outcome))
    return out


def summary(lanes: list[Lane], wall: float) -> str:
    """The per-tier table, the slowest tests, and a closing `total: N passed, N failed, N skipped` line."""
    rows, cases = [], []
    total = Tally()
    for lane in lanes:
        tally = Tally(seconds=lane.seconds)
        for name, seconds, outcome in read_junit(lane.junit):
            tally.tests += 1
            tally.failed += outcome == "failed"
            tally.skipped += outcome == "skipped"
            cases.append((seconds, lane.name, name))
        total.tests, total.failed, total.skipped = (total.tests + tally.tests, total.failed + tally.failed,
                                                    total.skipped + tally.skipped)  # fmt: skip
        if lane.returncode not in (0, None) and tally.failed == 0:
            tally.failed = 1  # the lane failed outside any test (collection, a fixture's teardown, a crash)
        state = "not run" if lane.returncode is None else ("ok" if lane.returncode == 0 else f"exit {lane.returncode}")
        rows.append(
            f"  {lane.name:<12} {tally.tests:>6} {tally.failed:>7} {tally.skipped:>8} {tally.seconds:>9.0f}  {state}"
        )
    lines = ["", "== test tiers (wall seconds per lane; lanes in one phase ran side by side)",
             f"  {'lane':<12} {'tests':>6} {'failed':>7} {'skipped':>8} {'seconds':>9}", *rows,
             f"  all: {wall:.0f} s wall ({wall / 60:.1f} min)",
             "", "== 20 slowest tests (setup + call + teardown)"]  # fmt: skip
    for seconds, lane_name, name in sorted(cases, reverse=True)[:20]:
        lines.append(f"  {seconds:8.1f} s  {lane_name:<12} {name}")
    passed = total.tests - total.failed - total.skipped
    lines += ["", f"total: {passed} passed, {total.failed} failed, {total.skipped} skipped"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    lanes = "unit, served, served-early, served-late, cluster, e2e, demo"
    parser.add_argument("--lanes", default="all", help=f"comma-separated lanes or tiers ({lanes})")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments for every lane (after --)")
    args = parser.parse_args(argv)
    phases = lanes_of(args.lanes)
    started = time.monotonic()
    basetemp = Path(tempfile.mkdtemp(prefix="omnikube-tests-"))
    every: list[Lane] = []
    for phase in phases:
        for script in phase.needs:
            wait_for_build(script)
        threads = [threading.Thread(target=run_sequence, args=(seq, basetemp, args.pytest_args)) for seq in phase.lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        every += [lane for seq in phase.lanes for lane in seq]
    failed = [lane for lane in every if lane.returncode not in (0,)]
    for lane in failed:
        if not lane.live:
            print(f"\n== output of lane {lane.name} (exit {lane.returncode}), {lane.log}", flush=True)
            sys.stdout.write(lane.log.read_text(errors="replace"))
    print(summary(every, time.monotonic() - started), flush=True)
    if failed:
        print(f"run_tests: FAILED lanes: {', '.join(lane.name for lane in failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
