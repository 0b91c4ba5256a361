"""The dependency rules of ARCHITECTURE.md, checked by import-linter's seven contracts in pyproject.toml:
the runtime never imports the operator; the spec and registry stay pure (no torch, no engines); process
settings and termination messages stay pure; operator builders and status never touch the API; the
runtime's layers only look down (router | stage > engines | wire > connectors | processors > spec |
metrics | settings); the engine families (ar, diffusion, speech) are independent of each other; and the
wire imports neither side, no engine and no ML library."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is part of the dev extra"
    out = subprocess.run([exe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_readmes_runtime_layout_names_every_package_and_only_those_that_exist() -> None:
    """The README's table of the runtime's layers is how a newcomer finds their way: every package and
    module of `omni_runtime` is in it, and everything it names exists."""
    import re

    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("Inside `runtime_image/omni_runtime/`") :]
    rows = [line for line in table.splitlines()[1:] if line.startswith("|")][2:]  # skip the header rows
    named = {name for row in rows for name in re.findall(r"`([\w.]+/?)`", row.split("|")[2])}
    root = REPO / "runtime_image" / "omni_runtime"
    present = {p.name + "/" if p.is_dir() else p.name for p in root.iterdir()}
    present -= {"__init__.py", "__pycache__/"}
    assert named == present, (
        f"named but absent: {sorted(named - present)}; present but not named: {sorted(present - named)}"
    )
