#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules (pinned in e2e/cluster/gomod/*/go.mod)
# into a cache folder outside the clone, keyed by the pins, and reuses them when present.
#
#   e2e/cluster/build.sh            # build (or reuse) and print the bin folder
#
# Binaries: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (k8s.io/kubernetes),
# etcd (go.etcd.io/etcd/server/v3) and helm (helm.sh/helm/v3) from one module (gomod/control-plane), built by one
# `go build` so the packages they share compile once; kwok (sigs.k8s.io/kwok) from its own (gomod/kwok).
# GO_BUILD_FLAGS (go-flags.sh) cut the compile's CPU: this build is most of a new machine's setup time.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${OMNIKUBE_CACHE:-$HOME/.cache/omnikube}
key=$( (go version; cat "$here/go-flags.sh" "$here"/gomod/*/go.mod "$here"/gomod/*/go.sum) | sha256sum | cut -c1-16)
bin="$cache_root/cluster/bin-$key"
want=(kube-apiserver kube-controller-manager kube-scheduler kubectl etcd kwok helm)

have_all() { for b in "${want[@]}"; do [ -x "$bin/$b" ] || return 1; done; }
if have_all; then echo "$bin"; exit 0; fi
# Concurrent calls wait for one another (flock), so `make test` may start a cold build in the background
# while the unit tests run; the e2e tier's call then waits for it.
mkdir -p "$cache_root/cluster"
exec 9>"$cache_root/cluster/.build.lock"
flock 9
if have_all; then echo "$bin"; exit 0; fi

mkdir -p "$bin.partial"
source "$here/go-flags.sh"
k8s_version=$(awk '$1=="k8s.io/kubernetes" {print $2}' "$here/gomod/control-plane/go.mod")
minor=$(echo "$k8s_version" | cut -d. -f2)
ver="k8s.io/component-base/version"
ldk8s="-s -w -X $ver.gitVersion=$k8s_version -X $ver.gitMajor=1 -X $ver.gitMinor=$minor -X $ver.gitTreeState=clean"
ldk8s="$ldk8s -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"

k8s=k8s.io/kubernetes/cmd
if [ ! -x "$bin.partial/helm" ]; then
  echo "building kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd, helm" >&2
  # One graph: shared packages compile once and the links run side by side. `-o dir/` names each binary after
  # its package's last element, so etcd's server/v3 comes out as `server`.
  (cd "$here/gomod/control-plane" && nice -n 10 go build "${GO_BUILD_FLAGS[@]}" -ldflags "$ldk8s" -o "$bin.partial/" \
    $k8s/kube-apiserver $k8s/kube-controller-manager $k8s/kube-scheduler $k8s/kubectl \
    go.etcd.io/etcd/server/v3 helm.sh/helm/v3/cmd/helm) >&2
  mv "$bin.partial/server" "$bin.partial/etcd"
fi
if [ ! -x "$bin.partial/kwok" ]; then
  echo "building kwok" >&2
  (cd "$here/gomod/kwok" && nice -n 10 go build "${GO_BUILD_FLAGS[@]}" -ldflags "-s -w" -o "$bin.partial/kwok" \
    sigs.k8s.io/kwok/cmd/kwok) >&2
fi
rm -rf "$bin" && mv "$bin.partial" "$bin"
echo "$bin"
