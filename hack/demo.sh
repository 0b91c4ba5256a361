#!/usr/bin/env bash
# `make demo`: bring up the local control plane, install the CRDs, apply a sample OmniPipeline, show it.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.omnikube/cluster
PY=.venv/bin/python

if [ -f "$DIR/state.json" ]; then
  echo "demo: reusing the running cluster in $DIR"
else
  $PY e2e/cluster/localcluster.py up --dir "$DIR"
fi
export KUBECONFIG=$PWD/$DIR/kubeconfig
BIN=$($PY -c "import json;print(json.load(open('$DIR/state.json'))['bin_dir'])")
export PATH="$BIN:$PATH"

echo "+ kubectl apply --server-side -f crds/"
kubectl apply --server-side -f crds/
kubectl wait --for=condition=Established --timeout=60s crd/omnipipelines.omnikube.io crd/omnistages.omnikube.io >/dev/null
echo "+ kubectl get nodes"
kubectl get nodes -L nvidia.com/gpu.product,omnikube.io/accelerator
echo "+ kubectl apply -f config/samples/"
kubectl apply -f config/samples/
echo "+ kubectl get omnipipelines -o wide"
kubectl get omnipipelines -o wide
cat <<MSG

The control plane keeps running. To use it:
  export KUBECONFIG=$KUBECONFIG PATH=$BIN:\$PATH
Tear it down with:
  make cluster-down
MSG
