// The protoc plugins that generate ../gen (scripts/gen_go_peer.py builds them through scripts/gobuild.py). Keep the
// google.golang.org/protobuf version equal to the peer's go.mod: the generated code checks the runtime it runs on.
module gpu-health-device-plugin/tests/conformance/nvsentinel/tools

go 1.26.0

tool (
	google.golang.org/grpc/cmd/protoc-gen-go-grpc
	google.golang.org/protobuf/cmd/protoc-gen-go
)

require (
	google.golang.org/grpc/cmd/protoc-gen-go-grpc v1.6.2 // indirect
	google.golang.org/protobuf v1.36.11 // indirect
)
