// The NVSentinel stand-in for the conformance tests (tests/conformance/test_nvsentinel*.py): a platform connector and
// a device API server generated from our api/nvsentinel protos (scripts/gen_go_peer.py regenerates gen/).
module gpu-health-device-plugin/tests/conformance/nvsentinel

go 1.26.0

require (
	google.golang.org/grpc v1.83.2
	google.golang.org/protobuf v1.36.11
)

require (
	golang.org/x/net v0.58.0 // indirect
	golang.org/x/sys v0.47.0 // indirect
	golang.org/x/text v0.41.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260526163538-3dc84a4a5aaa // indirect
)
