#!/usr/bin/env bash
# Cuts a copy of KEDA's source (github.com/kedacore/keda/v2, the version go.mod pins) down to the scalers the
# test tier uses, so its cold build compiles ~1,600 packages instead of ~3,340 (every cloud SDK of every
# scaler). All scalers live in one Go package (pkg/scalers), so leaving one out means deleting its file and its
# case of the trigger switch; KEDA marks that switch with TRIGGERS-START/-END, which we replace with ours.
#
#   trim.sh SRC_DIR     # edits SRC_DIR in place
#
# A ScaledObject naming any other trigger type gets KEDA's own "no scaler found for type" error.
#
# Cloud credentials go too (another ~360 packages of the AWS, Azure and GCP SDKs and the Vault client): the
# TriggerAuthentication secret stores (AWS Secrets Manager, Azure Key Vault, GCP Secret Manager, HashiCorp
# Vault), the Azure Event Grid event sink and the prometheus scaler's cloud auth (Azure managed Prometheus,
# GCP, AWS SigV4). Their stubs return an error naming this build when asked for, and "not configured" when
# not, as the real ones do for a plain in-cluster Prometheus (what the test tier uses).
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

# --- cloud credentials ------------------------------------------------------------------------------
notbuilt='fmt.Errorf("%s is not built into this KEDA (the omnikube test tier builds it without cloud SDKs: e2e/cluster/addons/keda/trim.sh)", what)'
for d in aws azure gcp; do
  find "$src/pkg/scalers/$d" -maxdepth 1 -name '*.go' -delete
done
cat > "$src/pkg/scalers/aws/omnikube_trim.go" <<GO
package aws

import (
	"fmt"
	"net/http"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/kedacore/keda/v2/pkg/scalers/scalersconfig"
)

func notBuilt(what string) error { return $notbuilt }

// NewSigV4RoundTripper: nil (no SigV4) unless the trigger asks for AWS (a region or an AWS pod identity).
func NewSigV4RoundTripper(config *scalersconfig.ScalerConfig, awsRegion string) (http.RoundTripper, error) {
	p := config.PodIdentity.Provider
	if awsRegion == "" && p != kedav1alpha1.PodIdentityProviderAws && p != kedav1alpha1.PodIdentityProviderAwsEKS {
		return nil, nil
	}
	return nil, notBuilt("AWS SigV4 authentication")
}
GO
cat > "$src/pkg/scalers/azure/omnikube_trim.go" <<GO
package azure

import (
	"fmt"
	"net/http"

	"github.com/go-logr/logr"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
)

const (
	ServicePrincipalAuthKey                      = "azureServicePrincipal"
	ServicePrincipalTenantIDKey                  = "azureServicePrincipalTenantId"
	ServicePrincipalClientIDKey                  = "azureServicePrincipalClientId"
	ServicePrincipalCloudKey                     = "azureServicePrincipalCloud"
	ServicePrincipalActiveDirectoryEndpointKey   = "azureServicePrincipalActiveDirectoryEndpoint"
	ServicePrincipalClientSecretKey              = "azureServicePrincipalClientSecret"
	ServicePrincipalClientCertificateKey         = "azureServicePrincipalClientCertificate"
	ServicePrincipalClientCertificatePasswordKey = "azureServicePrincipalClientCertificatePassword"
)

func notBuilt(what string) error { return $notbuilt }

// TryAndGetAzureManagedPrometheusHTTPRoundTripper: nil (not Azure managed Prometheus) unless the trigger
// has an Azure workload identity, as the real one decides.
func TryAndGetAzureManagedPrometheusHTTPRoundTripper(_ logr.Logger, podIdentity kedav1alpha1.AuthPodIdentity, _ map[string]string) (http.RoundTripper, error) {
	if podIdentity.Provider != kedav1alpha1.PodIdentityProviderAzureWorkload {
		return nil, nil
	}
	return nil, notBuilt("Azure managed Prometheus authentication")
}
GO
cat > "$src/pkg/scalers/gcp/omnikube_trim.go" <<GO
package gcp

import (
	"errors"
	"fmt"
	"net/http"
	"strings"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/kedacore/keda/v2/pkg/scalers/scalersconfig"
)

const GcpScopeMonitoringRead = "https://www.googleapis.com/auth/monitoring.read"

var ErrGoogleApplicationCrendentialsNotFound = errors.New("google application credentials not found")

func notBuilt(what string) error { return $notbuilt }

// GetGCPOAuth2HTTPTransport: ErrGoogleApplicationCrendentialsNotFound (no GCP auth) unless the trigger has a
// GCP pod identity or names Google application credentials.
func GetGCPOAuth2HTTPTransport(config *scalersconfig.ScalerConfig, _ http.RoundTripper, _ ...string) (http.RoundTripper, error) {
	asked := config.PodIdentity.Provider == kedav1alpha1.PodIdentityProviderGCP
	for _, m := range []map[string]string{config.TriggerMetadata, config.AuthParams} {
		for k := range m {
			asked = asked || strings.HasPrefix(strings.ToLower(k), "googleapplicationcredentials") || strings.HasPrefix(strings.ToLower(k), "credentialsfrom")
		}
	}
	if !asked {
		return nil, ErrGoogleApplicationCrendentialsNotFound
	}
	return nil, notBuilt("GCP authentication")
}
GO
rm "$src"/pkg/scaling/resolver/{aws_secretmanager,azure_keyvault,gcp_secretmanager,hashicorpvault}_handler*.go
cat > "$src/pkg/scaling/resolver/omnikube_trim.go" <<GO
package resolver

import (
	"context"
	"fmt"
	"net/url"
	"strings"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	corev1listers "k8s.io/client-go/listers/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/kedacore/keda/v2/pkg/scalers/authentication"
)

const DefaultVaultKubernetesAuthTokenFile = "/var/run/secrets/keda-vault/token"

func notBuilt(what string) error { return $notbuilt }

type HashicorpVaultHandler struct{}

func NewHashicorpVaultHandler(*kedav1alpha1.HashiCorpVault, *authentication.AuthClientSet, string) *HashicorpVaultHandler {
	return &HashicorpVaultHandler{}
}
func (*HashicorpVaultHandler) Initialize(logr.Logger) error { return notBuilt("HashiCorp Vault") }
func (*HashicorpVaultHandler) Stop()                         {}
func (*HashicorpVaultHandler) ResolveSecrets([]kedav1alpha1.VaultSecret) ([]kedav1alpha1.VaultSecret, error) {
	return nil, notBuilt("HashiCorp Vault")
}

// vaultAddressesEqual as KEDA's (the outbound policy's validation uses it).
func vaultAddressesEqual(a, b string) bool {
	ua, erra := url.Parse(strings.TrimSpace(a))
	ub, errb := url.Parse(strings.TrimSpace(b))
	if erra != nil || errb != nil {
		return false
	}
	if ua.User != nil || ub.User != nil || ua.Hostname() == "" || ub.Hostname() == "" {
		return false
	}
	if ua.Scheme != "http" && ua.Scheme != "https" || ub.Scheme != "http" && ub.Scheme != "https" {
		return false
	}
	return strings.EqualFold(ua.Scheme, ub.Scheme) && strings.EqualFold(ua.Host, ub.Host)
}

type AzureKeyVaultHandler struct{}

func NewAzureKeyVaultHandler(*kedav1alpha1.AzureKeyVault) *AzureKeyVaultHandler { return &AzureKeyVaultHandler{} }
func (*AzureKeyVaultHandler) Initialize(context.Context, client.Client, logr.Logger, string, corev1listers.SecretLister) error {
	return notBuilt("Azure Key Vault")
}
func (*AzureKeyVaultHandler) Read(context.Context, string, string) (string, error) {
	return "", notBuilt("Azure Key Vault")
}

type GCPSecretManagerHandler struct{}

func NewGCPSecretManagerHandler(*kedav1alpha1.GCPSecretManager) *GCPSecretManagerHandler {
	return &GCPSecretManagerHandler{}
}
func (*GCPSecretManagerHandler) Initialize(context.Context, client.Client, logr.Logger, string, corev1listers.SecretLister) error {
	return notBuilt("GCP Secret Manager")
}
func (*GCPSecretManagerHandler) Read(context.Context, string, string) (string, error) {
	return "", notBuilt("GCP Secret Manager")
}

type AwsSecretManagerHandler struct{}

func NewAwsSecretManagerHandler(*kedav1alpha1.AwsSecretManager) *AwsSecretManagerHandler {
	return &AwsSecretManagerHandler{}
}
func (*AwsSecretManagerHandler) Initialize(context.Context, client.Client, logr.Logger, string, corev1listers.SecretLister, *corev1.PodSpec) error {
	return notBuilt("AWS Secrets Manager")
}
func (*AwsSecretManagerHandler) Read(context.Context, logr.Logger, string, string, string, string) (string, error) {
	return "", notBuilt("AWS Secrets Manager")
}
func (*AwsSecretManagerHandler) Stop() {}
GO
rm "$src"/pkg/eventemitter/azure_event_grid_topic_handler*.go
cat > "$src/pkg/eventemitter/omnikube_trim.go" <<GO
package eventemitter

import (
	"context"
	"fmt"

	"github.com/go-logr/logr"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	eventingv1alpha1 "github.com/kedacore/keda/v2/apis/eventing/v1alpha1"
	kedav1alpha1 "github.com/kedacore/keda/v2/apis/keda/v1alpha1"
	"github.com/kedacore/keda/v2/pkg/eventemitter/eventdata"
)

type AzureEventGridTopicHandler struct{}

func NewAzureEventGridTopicHandler(context.Context, string, *eventingv1alpha1.AzureEventGridTopicSpec, map[string]string, kedav1alpha1.AuthPodIdentity, logr.Logger) (*AzureEventGridTopicHandler, error) {
	what := "the Azure Event Grid event sink"
	return nil, $notbuilt
}
func (*AzureEventGridTopicHandler) CloseHandler()                              {}
func (*AzureEventGridTopicHandler) SetActiveStatus(metav1.ConditionStatus)     {}
func (*AzureEventGridTopicHandler) GetActiveStatus() metav1.ConditionStatus    { return metav1.ConditionFalse }
func (*AzureEventGridTopicHandler) EmitEvent(eventdata.EventData, func(eventdata.EventData, error)) {}
GO
