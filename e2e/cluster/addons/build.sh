#!/usr/bin/env bash
# Builds an add-on of the test tier from its Go module (pinned in e2e/cluster/addons/<name>/go.mod) into a
# cache folder outside the clone, keyed by the pins and the Go version, and reuses it when present. Kept
# apart from the control plane's build (e2e/cluster/build.sh), so pinning an add-on rebuilds only it.
#
#   e2e/cluster/addons/build.sh prometheus     # build (or reuse) and print the binary's path
#   e2e/cluster/addons/build.sh keda           # the operator's path; keda-adapter lies next to it
#
# prometheus: ./cmd/prometheus of github.com/prometheus/prometheus, with every optional service discovery
#             left out (tag remove_all_sd: the tests give it file_sd targets).
# keda:       ./cmd/operator and ./cmd/adapter (the external-metrics API server) of github.com/kedacore/keda/v2,
#             built as KEDA builds itself (its own go.mod and go.sum) from a copy of the module whose scalers
#             keda/trim.sh cuts to cpu, memory and prometheus, without cloud credentials: the full set compiles
#             every cloud SDK (3,338 packages, 25 min cold here), too long for CI; cut, ~1,600 packages.
# Concurrent calls wait for one another (flock), so CI may start a build early in the background.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
name=${1:?usage: build.sh prometheus|keda}
cache_root=${OMNIKUBE_CACHE:-$HOME/.cache/omnikube}
case "$name" in
  prometheus) pkg=github.com/prometheus/prometheus/cmd/prometheus tags=remove_all_sd ;;
  keda) pkg=github.com/kedacore/keda/v2 tags= ;;
  *) echo "build.sh: unknown add-on $name (known: prometheus, keda)" >&2; exit 2 ;;
esac
# The key covers what decides the binary: Go, the pins and (keda) the trim.
key=$( (go version; echo "$tags"; cat "$here/../go-flags.sh" "$here/$name"/*) | sha256sum | cut -c1-16)
dir="$cache_root/addons/$name-$key"
mkdir -p "$cache_root/addons"
exec 9>"$cache_root/addons/.$name.lock"
flock 9
if [ -x "$dir/$name" ]; then echo "$dir/$name"; exit 0; fi
rm -rf "$dir.partial" && mkdir -p "$dir.partial"
echo "building $name from $pkg (cold: minutes)" >&2
source "$here/../go-flags.sh"
if [ "$name" = keda ]; then
  version=$(awk -v m="$pkg" '$1 == "require" && $2 == m { print $3 }' "$here/keda/go.mod")
  module_dir=$(cd "$here/keda" && go mod download -json "$pkg@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  src="$dir.partial/src"
  cp -r "$module_dir" "$src" && chmod -R u+w "$src"
  bash "$here/keda/trim.sh" "$src"
  (cd "$src" && nice -n 10 go build "${GO_BUILD_FLAGS[@]}" -ldflags '-s -w' \
    -o "$dir.partial/" ./cmd/operator ./cmd/adapter) >&2
  mv "$dir.partial/operator" "$dir.partial/keda" && mv "$dir.partial/adapter" "$dir.partial/keda-adapter"
  rm -rf "$src"
else
  (cd "$here/$name" && nice -n 10 \
    go build "${GO_BUILD_FLAGS[@]}" -tags "$tags" -ldflags '-s -w' -o "$dir.partial/$name" "$pkg") >&2
fi
rm -rf "$dir" && mv "$dir.partial" "$dir"
echo "$dir/$name"
