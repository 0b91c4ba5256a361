#!/usr/bin/env bash
# Builds the local control plane's binaries from Go modules (pinned in e2e/cluster/gomod/*/go.mod)
# into a cache folder outside the clone, keyed by the pins, and reuses them when present.
#
#   e2e/cluster/build.sh            # build (or reuse) and print the bin folder
#
# Binaries: kube-apiserver, kube-controller-manager, kube-scheduler, kubectl (k8s.io/kubernetes),
# etcd (go.etcd.io/etcd/server/v3), kwok (sigs.k8s.io/kwok), helm (helm.sh/helm/v3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${OMNIKUBE_CACHE:-$HOME/.cache/omnikube}
key=$( (go version; cat "$here"/gomod/*/go.mod "$here"/gomod/*/go.sum) | sha256sum | cut -c1-16)
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
export GOFLAGS=-mod=mod CGO_ENABLED=0
k8s_version=$(awk '$1=="require" && $2=="k8s.io/kubernetes" {print $3}' "$here/gomod/kubernetes/go.mod")
minor=$(echo "$k8s_version" | cut -d. -f2)
ver="k8s.io/component-base/version"
ldk8s="-s -w -X $ver.gitVersion=$k8s_version -X $ver.gitMajor=1 -X $ver.gitMinor=$minor -X $ver.gitTreeState=clean"
ldk8s="$ldk8s -X k8s.io/client-go/pkg/version.gitVersion=$k8s_version"

build() { # module-dir ldflags binary-name=package...
  local dir=$1 ld=$2; shift 2
  for spec in "$@"; do
    local name=${spec%%=*} pkg=${spec#*=}
    [ -x "$bin.partial/$name" ] && continue
    echo "building $name from $pkg" >&2
    (cd "$here/gomod/$dir" && nice -n 10 go build -trimpath -ldflags "$ld" -o "$bin.partial/$name" "$pkg") >&2
  done
}
k8s=k8s.io/kubernetes/cmd
build kubernetes "$ldk8s" kube-apiserver=$k8s/kube-apiserver kube-controller-manager=$k8s/kube-controller-manager \
  kube-scheduler=$k8s/kube-scheduler kubectl=$k8s/kubectl
build etcd "-s -w" etcd=go.etcd.io/etcd/server/v3
build kwok "-s -w" kwok=sigs.k8s.io/kwok/cmd/kwok
build helm "-s -w" helm=helm.sh/helm/v3/cmd/helm
rm -rf "$bin" && mv "$bin.partial" "$bin"
echo "$bin"
