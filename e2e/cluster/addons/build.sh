#!/usr/bin/env bash
# Builds an add-on of the test tier from its Go module (pinned in e2e/cluster/addons/<name>/go.mod) into a
# cache folder outside the clone, keyed by the pins and the Go version, and reuses it when present. Kept
# apart from the control plane's build (e2e/cluster/build.sh), so pinning an add-on rebuilds only it.
#
#   e2e/cluster/addons/build.sh prometheus     # build (or reuse) and print the binary's path
#
# prometheus: ./cmd/prometheus of github.com/prometheus/prometheus, with every optional service discovery
#             left out (tag remove_all_sd: the tests give it file_sd targets).
# Concurrent calls wait for one another (flock), so CI may start a build early in the background.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
name=${1:?usage: build.sh prometheus}
cache_root=${OMNIKUBE_CACHE:-$HOME/.cache/omnikube}
case "$name" in
  prometheus) pkg=github.com/prometheus/prometheus/cmd/prometheus tags=remove_all_sd ;;
  *) echo "build.sh: unknown add-on $name (known: prometheus)" >&2; exit 2 ;;
esac
key=$( (go version; echo "$tags"; cat "$here/$name/go.mod" "$here/$name/go.sum") | sha256sum | cut -c1-16)
dir="$cache_root/addons/$name-$key"
mkdir -p "$cache_root/addons"
exec 9>"$cache_root/addons/.$name.lock"
flock 9
if [ -x "$dir/$name" ]; then echo "$dir/$name"; exit 0; fi
rm -rf "$dir.partial" && mkdir -p "$dir.partial"
echo "building $name from $pkg (cold: minutes)" >&2
(cd "$here/$name" && GOFLAGS=-mod=mod CGO_ENABLED=0 nice -n 10 \
  go build -trimpath -tags "$tags" -ldflags '-s -w' -o "$dir.partial/$name" "$pkg") >&2
rm -rf "$dir" && mv "$dir.partial" "$dir"
echo "$dir/$name"
