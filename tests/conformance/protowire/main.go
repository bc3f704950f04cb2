// Prints the kubelet's own descriptors of the gRPC APIs this project speaks (k8s.io/kubelet, the release pinned in
// go.mod) as one JSON object keyed by API ("dra/v1", ...), each a google.protobuf.FileDescriptorProto in protojson.
// tests/conformance/test_proto_wire.py compares them with the descriptors of api/*/*.proto, so a proto of ours that
// drifts from the kubelet's wire contract fails a test instead of a kubelet call.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"

	deviceplugin "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	drav1 "k8s.io/kubelet/pkg/apis/dra/v1"
	drav1beta1 "k8s.io/kubelet/pkg/apis/dra/v1beta1"
	drahealthv1 "k8s.io/kubelet/pkg/apis/dra-health/v1"
	drahealthv1alpha1 "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
	podresources "k8s.io/kubelet/pkg/apis/podresources/v1"
	registration "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

func main() {
	files := map[string]protoreflect.FileDescriptor{
		"deviceplugin/v1beta1":  deviceplugin.File_staging_src_k8s_io_kubelet_pkg_apis_deviceplugin_v1beta1_api_proto,
		"podresources/v1":       podresources.File_staging_src_k8s_io_kubelet_pkg_apis_podresources_v1_api_proto,
		"pluginregistration/v1": registration.File_staging_src_k8s_io_kubelet_pkg_apis_pluginregistration_v1_api_proto,
		"dra/v1":                drav1.File_staging_src_k8s_io_kubelet_pkg_apis_dra_v1_api_proto,
		"dra/v1beta1":           drav1beta1.File_staging_src_k8s_io_kubelet_pkg_apis_dra_v1beta1_api_proto,
		"dra-health/v1":         drahealthv1.File_staging_src_k8s_io_kubelet_pkg_apis_dra_health_v1_api_proto,
		"dra-health/v1alpha1":   drahealthv1alpha1.File_staging_src_k8s_io_kubelet_pkg_apis_dra_health_v1alpha1_api_proto,
	}
	out := map[string]json.RawMessage{}
	for name, fd := range files {
		raw, err := protojson.Marshal(protodesc.ToFileDescriptorProto(fd))
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
			os.Exit(1)
		}
		out[name] = raw
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
