module omnikube.local/e2e/keda-bin

go 1.24.0

require github.com/kedacore/keda/v2 v2.21.0
