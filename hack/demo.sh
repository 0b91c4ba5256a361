#!/usr/bin/env bash
# `make demo`: the whole product on this machine, as a new user would meet it.
#   1. a real Kubernetes control plane (built from Go modules) with KWOK GPU/NPU nodes,
#   2. the pod runner, which runs pods on node runner-node-0 as real processes (no Docker needed),
#   3. `helm install` of the chart: CRDs, RBAC and the operator, whose pod really runs on runner-node-0,
#   4. an OmniPipeline serving a tiny chat model and a tiny text-to-image model, built locally,
#   5. one chat and one image request with the official openai client, through the router pod.
# Tear down with `make demo-down`.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$PWD/.omnikube
PY=$PWD/.venv/bin/python
NS=omnikube-demo

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "control plane"
if [ -f "$DIR/cluster/state.json" ]; then
  echo "reusing the running cluster in $DIR/cluster"
else
  "$PY" e2e/cluster/localcluster.py up --dir "$DIR/cluster"
fi
export KUBECONFIG=$DIR/cluster/kubeconfig
BIN=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['bin_dir'])" "$DIR/cluster/state.json")
export PATH="$BIN:$PWD/.venv/bin:$PATH"
kubectl get nodes -L nvidia.com/gpu.product,omnikube.io/accelerator
on_error() {
  printf '\n\033[1mmake demo stopped on an error.\033[0m What runs stays up; look around with:\n'
  printf '  export KUBECONFIG=%q PATH=%q:$PATH\n' "$KUBECONFIG" "$BIN"
  printf '  kubectl get pods -A -o wide; kubectl describe pod -n NAMESPACE POD; kubectl logs -n NAMESPACE POD\n'
  printf '  the pod runner'"'"'s own log: %s\n' "$DIR/podrunner.log"
  printf 'then `make demo` again (it reuses what runs) or `make demo-down`.\n'
}
trap on_error ERR

step "pod runner (runs the pods of runner-node-0 as local processes)"
if [ -f "$DIR/podrunner.pid" ] && kill -0 "$(cat "$DIR/podrunner.pid")" 2>/dev/null; then
  echo "already running (pid $(cat "$DIR/podrunner.pid"))"
else
  mkdir -p "$DIR/podrunner"
  setsid "$PY" e2e/podrunner/runner.py --kubeconfig "$KUBECONFIG" --node runner-node-0 \
    --state-dir "$DIR/podrunner" --capacity cpu=16 --capacity memory=64Gi \
    > "$DIR/podrunner.log" 2>&1 < /dev/null &
  echo $! > "$DIR/podrunner.pid"
fi
for _ in $(seq 60); do kubectl get node runner-node-0 >/dev/null 2>&1 && break; sleep 1; done
kubectl wait --for=condition=Ready node/runner-node-0 --timeout=120s

step "helm install omnikube (CRDs, RBAC, operator)"
RUNNER_SET=(--set-string "nodeSelector.omnikube\.io/podrunner=true"
            --set "tolerations[0].key=omnikube.io/podrunner" --set "tolerations[0].operator=Exists"
            --set "tolerations[0].effect=NoSchedule")
helm upgrade --install omnikube charts/omnikube --namespace omnikube-system --create-namespace \
  --set replicas=1 "${RUNNER_SET[@]}" --wait --timeout 5m
kubectl get pods -n omnikube-system -o wide

step "tiny models (random weights, built locally)"
"$PY" -m omni_runtime.tiny_models tiny-qwen2-chat tiny-sd3
MODELS=$("$PY" -c "from omni_runtime.tiny_models import default_cache_dir; print(default_cache_dir())")

step "kubectl apply OmniPipelines"
kubectl create namespace $NS --dry-run=client -o yaml | kubectl apply -f - >/dev/null
for spec in "chat text-chat tiny-qwen2-chat llm {max_model_len: 512, kv_cache_memory_bytes: 268435456}" \
            "draw stable-diffusion-3 tiny-sd3 dit {}"; do
  read -r name topology model stage args <<<"$spec"
  kubectl apply -n $NS -f - <<YAML
apiVersion: omnikube.io/v1alpha1
kind: OmniPipeline
metadata:
  name: $name
spec:
  model: $model
  pipeline: $topology
  servedModelName: $name
  runtime:
    modelCache: {hostPath: {path: $MODELS}, mountPath: /models, readOnly: true}
  router:
    nodeSelector: {omnikube.io/podrunner: "true"}
    tolerations: [{key: omnikube.io/podrunner, operator: Exists, effect: NoSchedule}]
  stages:
    - name: $stage
      engineArgs: $args
      nodeSelector: {omnikube.io/podrunner: "true"}
      tolerations: [{key: omnikube.io/podrunner, operator: Exists, effect: NoSchedule}]
YAML
done
echo "waiting for Ready (loading vLLM on a CPU takes a minute or two)..."
kubectl wait -n $NS --for=condition=Ready omnipipeline/chat omnipipeline/draw --timeout=15m
kubectl get omnipipelines,omnistages -n $NS -o wide

step "calling the API with the openai client"
router_ip() {
  kubectl get pods -n $NS -l "omnikube.io/pipeline=$1,app.kubernetes.io/component=router" \
    -o jsonpath='{.items[0].status.podIP}'
}
NO_PROXY='*' "$PY" - "$(router_ip chat)" "$(router_ip draw)" "$DIR" <<'PYEOF'
import base64, sys
from pathlib import Path
from openai import OpenAI

chat_ip, draw_ip, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
chat = OpenAI(base_url=f"http://{chat_ip}:8000/v1", api_key="unused")
reply = chat.chat.completions.create(model="chat", messages=[{"role": "user", "content": "Say hello!"}],
                                     max_tokens=16)
print(f"chat ({chat.base_url}): {reply.choices[0].message.content!r}")
print("  (random weights: the words are noise, the plumbing is real)")
draw = OpenAI(base_url=f"http://{draw_ip}:8000/v1", api_key="unused")
image = draw.images.generate(model="draw", prompt="a red cube", size="64x64", response_format="b64_json")
path = out / "demo-image.png"
path.write_bytes(base64.b64decode(image.data[0].b64_json))
print(f"image ({draw.base_url}): saved to {path}")
PYEOF

CHAT_IP=$(router_ip chat)
DRAW_IP=$(router_ip draw)
cat <<MSG

Everything keeps running. The routers answer on their pod IPs (the pod runner's bridge; reachable from
this host, not from other machines; there is no kube-proxy, so Service IPs and port-forward do not route):
  chat  http://$CHAT_IP:8000/v1   (OpenAI API, model "chat")
  draw  http://$DRAW_IP:8000/v1   (OpenAI API, model "draw")
For example:
  curl --noproxy '*' http://$CHAT_IP:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"model": "chat", "messages": [{"role": "user", "content": "Say hello!"}], "max_tokens": 16}'

kubectl talks to the demo cluster with:
  export KUBECONFIG=$(printf %q "$KUBECONFIG") PATH=$(printf %q "$BIN"):\$PATH
  kubectl get omnipipelines,omnistages,pods -n $NS -o wide
  kubectl logs -n $NS -f deploy/chat-router          # logs work for every pod on runner-node-0
  kubectl describe omnipipeline -n $NS chat
A pod's IP changes when the pod is replaced; the IP column of \`kubectl get pods -n $NS -o wide\` has the new one.
Tear down with:
  make demo-down
MSG
