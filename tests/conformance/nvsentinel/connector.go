package main

import (
	"context"
	"encoding/json"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	pc "gpu-health-device-plugin/tests/conformance/nvsentinel/gen/platformconnector"
)

// connectorServer is the platform connector's intake. Like NVSentinel's, it reads an unset processingStrategy as
// EXECUTE_REMEDIATION and refuses a batch holding a CUSTOM action without customRecommendedAction; with strict (the
// default) it also refuses events without nodeName, checkName or agent, which NVSentinel takes but cannot place.
type connectorServer struct {
	pc.UnimplementedPlatformConnectorServer
	events    *jsonLines
	failCode  codes.Code
	strict    bool
	mu        sync.Mutex
	failFirst int
	calls     int
}

// record is one line of --events: the batch as NVSentinel keeps it, and what the sender really put in
// processingStrategy before normalisation.
type record struct {
	Call                  int             `json:"call"`
	Received              string          `json:"received"`
	Batch                 json.RawMessage `json:"batch"`
	RawProcessingStrategy []string        `json:"rawProcessingStrategy"`
}

var batchJSON = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}

func (c *connectorServer) HealthEventOccurredV1(_ context.Context, in *pc.HealthEvents) (*emptypb.Empty, error) {
	c.mu.Lock()
	defer c.mu.Unlock() // one call at a time keeps the file in arrival order
	c.calls++
	if c.calls <= c.failFirst {
		return nil, status.Errorf(c.failCode, "refusing call %d of the first %d (--fail-first)", c.calls, c.failFirst)
	}
	batch := proto.Clone(in).(*pc.HealthEvents)
	raw := make([]string, 0, len(batch.Events))
	for i, e := range batch.Events {
		if e.RecommendedAction == pc.RecommendedAction_CUSTOM && e.CustomRecommendedAction == "" {
			return nil, status.Errorf(codes.InvalidArgument,
				"events[%d]: recommendedAction is CUSTOM but customRecommendedAction is empty", i)
		}
		if c.strict {
			for field, value := range map[string]string{"nodeName": e.NodeName, "checkName": e.CheckName, "agent": e.Agent} {
				if value == "" {
					return nil, status.Errorf(codes.InvalidArgument, "events[%d]: %s is empty", i, field)
				}
			}
		}
		raw = append(raw, e.ProcessingStrategy.String())
		if e.ProcessingStrategy == pc.ProcessingStrategy_UNSPECIFIED {
			e.ProcessingStrategy = pc.ProcessingStrategy_EXECUTE_REMEDIATION
		}
	}
	body, err := batchJSON.Marshal(batch)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encode batch: %v", err)
	}
	line, err := json.Marshal(record{
		Call: c.calls, Received: time.Now().UTC().Format(time.RFC3339Nano), Batch: body, RawProcessingStrategy: raw,
	})
	if err != nil {
		return nil, status.Errorf(codes.Internal, "encode record: %v", err)
	}
	if err := c.events.write(line); err != nil {
		return nil, status.Errorf(codes.Internal, "record batch: %v", err)
	}
	return &emptypb.Empty{}, nil
}
