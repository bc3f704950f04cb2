// Standard-library-only helper that writes throw-away certificates and keys for the loopback
// kube-apiserver. Its own module so that editing it does not change the kube-apiserver cache key.
module gpu-health-device-plugin/tests/conformance/apiserver/testpki

go 1.26.0
