#!/usr/bin/env bash
# Installs everything the tests and the demo need on a fresh Debian machine, reusing caches when present:
#   apt packages, uv, the .venv (runtime on CPU + operator + dev tools), the control-plane binaries.
# Idempotent: a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${OMNIKUBE_CLUSTER_BUILD:-}" = background ]; then
  # `make test`: only the e2e tier (after the lint and the unit tests) needs the Go binaries; it waits for
  # these builds (each build.sh holds a lock). They start first: on a new machine their module downloads and
  # compiles (cold: ~20 CPU-min) overlap the apt and wheel downloads and the lint, not only the unit tests.
  echo "bootstrap: control plane, Prometheus and KEDA build in the background (.omnikube/*-build.log)"
  mkdir -p .omnikube
  (bash e2e/cluster/build.sh > .omnikube/cluster-build.log 2>&1 &)
  (bash e2e/cluster/addons/build.sh prometheus > .omnikube/prometheus-build.log 2>&1 &)
  (bash e2e/cluster/addons/build.sh keda > .omnikube/keda-build.log 2>&1 &)
fi

APT_PACKAGES=(libibverbs1 librdmacm1 libnuma1 iproute2 openssl)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if ! command -v uv >/dev/null 2>&1; then
  echo "bootstrap: installing uv"
  "$PY" -m pip install -q "uv==0.13.8"
fi
UV=$(command -v uv || echo "$("$PY" -c 'import sysconfig;print(sysconfig.get_path("scripts"))')/uv")

# Reinstall only when the dependency declarations changed.
stamp=$(cat pyproject.toml requirements/cpu-overrides.txt | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.omnikube-stamp 2>/dev/null)" != "$stamp" ]; then
  echo "bootstrap: creating .venv"
  [ -x .venv/bin/python ] || "$UV" venv -q -p "$(command -v "$PY")" .venv
  "$UV" pip install -q -p .venv/bin/python -e '.[operator,runtime-cpu,dev]' \
    --override requirements/cpu-overrides.txt --compile-bytecode
  echo "$stamp" > .venv/.omnikube-stamp
fi

# Byte-compile the whole environment once (a .venv made before this step, or packages uv left as they were).
# Python writes no .pyc where PYTHONDONTWRITEBYTECODE is set (many CI and container images) or where it cannot
# write; then every process compiles what it imports from source, each time: importing vLLM's engine core
# costs about 17 CPU-seconds instead of 10, and every stage, engine core, router and test process pays it.
if [ ! -f .venv/.omnikube-bytecode ]; then
  echo "bootstrap: byte-compiling .venv (once; a minute or two on two cores)"
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  # -qq: a few packages ship Python 2 or template files that do not compile; they are never imported
  .venv/bin/python -m compileall -qq -j 0 "$site" || true
  touch .venv/.omnikube-bytecode
fi

if [ "${OMNIKUBE_CLUSTER_BUILD:-}" != background ]; then
  echo "bootstrap: control-plane binaries"
  bash e2e/cluster/build.sh >/dev/null
fi
echo "bootstrap: done"
