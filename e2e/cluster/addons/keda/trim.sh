#!/usr/bin/env bash
# Cuts a copy of KEDA's source (github.com/kedacore/keda/v2, the version go.mod pins) down to the scalers the
# test tier uses, so its cold build compiles ~1,960 packages instead of ~3,340 (every cloud SDK of every
# scaler). All scalers live in one Go package (pkg/scalers), so leaving one out means deleting its file and its
# case of the trigger switch; KEDA marks that switch with TRIGGERS-START/-END, which we replace with ours.
#
#   trim.sh SRC_DIR     # edits SRC_DIR in place
#
# A ScaledObject naming any other trigger type gets KEDA's own "no scaler found for type" error.
set -euo pipefail
src=${1:?usage: trim.sh SRC_DIR}
keep="prometheus_scaler.go cpu_memory_scaler.go"
for f in "$src"/pkg/scalers/*_scaler.go; do
  case " $keep " in *" $(basename "$f") "*) ;; *) rm "$f" ;; esac
done
rm -f "$src"/pkg/scalers/*_test.go  # tests of deleted scalers would not compile (and are not built anyway)
# Shared by every scaler but declared in azure_queue_scaler.go.
printf 'package scalers\n\nconst externalMetricType = "External"\n' > "$src/pkg/scalers/omnikube_trim.go"
builder="$src/pkg/scaling/scalers_builder.go"
grep -q 'TRIGGERS-START' "$builder" && grep -q 'TRIGGERS-END' "$builder" || {
  echo "trim.sh: $builder has no TRIGGERS-START/TRIGGERS-END markers; update trim.sh for this KEDA version" >&2
  exit 1
}
awk '
  /\/\/ TRIGGERS-START/ {
    print
    print "\tswitch triggerType {"
    print "\tcase \"cpu\":"
    print "\t\treturn scalers.NewCPUMemoryScaler(corev1.ResourceCPU, config)"
    print "\tcase \"memory\":"
    print "\t\treturn scalers.NewCPUMemoryScaler(corev1.ResourceMemory, config)"
    print "\tcase \"prometheus\":"
    print "\t\treturn scalers.NewPrometheusScaler(config)"
    print "\tdefault:"
    print "\t\treturn nil, fmt.Errorf(\"no scaler found for type: %s (this KEDA is built for the omnikube test tier with cpu, memory and prometheus only)\", triggerType)"
    print "\t}"
    skip = 1
    next
  }
  /\/\/ TRIGGERS-END/ { skip = 0 }
  !skip
' "$builder" > "$builder.new"
mv "$builder.new" "$builder"
