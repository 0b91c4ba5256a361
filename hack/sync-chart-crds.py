#!/usr/bin/env python3
"""Copy the generated CRDs (crds/*.yaml) into the Helm chart (charts/omnikube/files/crds/).

    python hack/sync-chart-crds.py          # copy; removes chart CRDs that crds/ no longer has
    python hack/sync-chart-crds.py --check  # exit 1, naming the files, when the chart has drifted

The chart's `templates/crds.yaml` reads these files with `.Files.Get` and only adds Helm's labels and
the `helm.sh/resource-policy: keep` annotation, so what Helm installs is byte for byte what
`omnikube crds` prints. tests/test_chart.py runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "crds"
TARGET = ROOT / "charts" / "omnikube" / "files" / "crds"


def drift(source: Path = SOURCE, target: Path = TARGET) -> list[str]:
    """What differs between crds/ and the chart's copy, one line per file; empty when in step."""
    want = {p.name: p.read_bytes() for p in sorted(source.glob("*.yaml"))}
    have = {p.name: p.read_bytes() for p in sorted(target.glob("*.yaml"))} if target.is_dir() else {}
    problems = []
    for name in sorted(want.keys() | have.keys()):
        if name not in have:
            problems.append(f"{target / name}: missing (crds/{name} exists)")
        elif name not in want:
            problems.append(f"{target / name}: stale (crds/ has no {name})")
        elif want[name] != have[name]:
            problems.append(f"{target / name}: differs from crds/{name}")
    return problems


def sync(source: Path = SOURCE, target: Path = TARGET) -> list[str]:
    """Make the chart's copy equal crds/; returns what was changed."""
    changed = drift(source, target)
    target.mkdir(parents=True, exist_ok=True)
    for stale in target.glob("*.yaml"):
        if not (source / stale.name).exists():
            stale.unlink()
    for path in source.glob("*.yaml"):
        (target / path.name).write_bytes(path.read_bytes())
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the chart's CRDs differ from crds/")
    args = parser.parse_args(argv)
    if args.check:
        problems = drift()
        for line in problems:
            print(line, file=sys.stderr)
        if problems:
            print("run: python hack/sync-chart-crds.py", file=sys.stderr)
        return 1 if problems else 0
    for line in sync():
        print(f"synced: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
