package main

import (
	"context"
	"encoding/json"
	"sort"
	"strconv"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	deviceapi "gpu-health-device-plugin/tests/conformance/nvsentinel/gen/deviceapi/v1alpha1"
)

// A watcher that falls this far behind is cut off (its stream ends with RESOURCE_EXHAUSTED) rather than let it
// block every writer.
const watchBuffer = 4096

type watcher struct {
	events chan *deviceapi.WatchGpusResponse
	gone   chan struct{} // closed when the server cuts the watcher off
}

// deviceServer keeps GPUs in memory, as NVSentinel's node-local device API does: lost on restart, so a provider
// must register its GPUs again when it reconnects.
type deviceServer struct {
	deviceapi.UnimplementedGpuServiceServer
	log      *jsonLines
	mu       sync.Mutex
	gpus     map[string]*deviceapi.Gpu
	version  int64 // one counter for the whole store: every write gets a larger resource_version
	watchers map[*watcher]struct{}
	closed   bool
}

func newDeviceServer(log *jsonLines) *deviceServer {
	return &deviceServer{log: log, gpus: map[string]*deviceapi.Gpu{}, watchers: map[*watcher]struct{}{}}
}

type writeRecord struct {
	Operation       string          `json:"operation"`
	Name            string          `json:"name"`
	ResourceVersion int64           `json:"resource_version"`
	Status          json.RawMessage `json:"status"`
}

var statusJSON = protojson.MarshalOptions{UseProtoNames: true}

// commit stamps a new resource version on gpu, logs the write and tells the watchers. Called with mu held.
func (d *deviceServer) commit(operation, eventType string, gpu *deviceapi.Gpu) error {
	d.version++
	gpu.ResourceVersion = d.version
	if gpu.Metadata == nil {
		gpu.Metadata = &deviceapi.ObjectMeta{}
	}
	gpu.Metadata.ResourceVersion = strconv.FormatInt(d.version, 10)
	st := []byte("null")
	if gpu.Status != nil {
		var err error
		if st, err = statusJSON.Marshal(gpu.Status); err != nil {
			return status.Errorf(codes.Internal, "encode status: %v", err)
		}
	}
	line, err := json.Marshal(writeRecord{operation, gpu.Metadata.Name, d.version, st})
	if err != nil {
		return status.Errorf(codes.Internal, "encode write: %v", err)
	}
	if err := d.log.write(line); err != nil {
		return status.Errorf(codes.Internal, "log write: %v", err)
	}
	d.broadcast(eventType, gpu)
	return nil
}

func (d *deviceServer) broadcast(eventType string, gpu *deviceapi.Gpu) {
	ev := &deviceapi.WatchGpusResponse{Type: eventType, Object: proto.Clone(gpu).(*deviceapi.Gpu)}
	for w := range d.watchers {
		select {
		case w.events <- ev:
		default:
			delete(d.watchers, w)
			close(w.gone)
		}
	}
}

// closeWatches ends every watch stream (shutdown).
func (d *deviceServer) closeWatches() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	for w := range d.watchers {
		delete(d.watchers, w)
		close(w.gone)
	}
}

func (d *deviceServer) lookup(name string) (*deviceapi.Gpu, error) {
	if name == "" {
		return nil, status.Error(codes.InvalidArgument, "name is empty")
	}
	gpu, ok := d.gpus[name]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "gpu %q not found", name)
	}
	return gpu, nil
}

// checkVersion refuses a write based on an older read; zero means "whatever is current".
func checkVersion(gpu *deviceapi.Gpu, given int64) error {
	if given != 0 && given != gpu.ResourceVersion {
		return status.Errorf(codes.Aborted, "gpu %q: resource_version %d is stale (current %d)",
			gpu.Metadata.GetName(), given, gpu.ResourceVersion)
	}
	return nil
}

func (d *deviceServer) GetGpu(_ context.Context, in *deviceapi.GetGpuRequest) (*deviceapi.GetGpuResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	gpu, err := d.lookup(in.Name)
	if err != nil {
		return nil, err
	}
	return &deviceapi.GetGpuResponse{Gpu: proto.Clone(gpu).(*deviceapi.Gpu)}, nil
}

// sorted returns copies of every GPU by name. Called with mu held.
func (d *deviceServer) sorted() []*deviceapi.Gpu {
	names := make([]string, 0, len(d.gpus))
	for name := range d.gpus {
		names = append(names, name)
	}
	sort.Strings(names)
	out := make([]*deviceapi.Gpu, 0, len(names))
	for _, name := range names {
		out = append(out, proto.Clone(d.gpus[name]).(*deviceapi.Gpu))
	}
	return out
}

func (d *deviceServer) ListGpus(context.Context, *deviceapi.ListGpusRequest) (*deviceapi.ListGpusResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return &deviceapi.ListGpusResponse{GpuList: &deviceapi.GpuList{
		Metadata: &deviceapi.ListMeta{ResourceVersion: strconv.FormatInt(d.version, 10)},
		Items:    d.sorted(),
	}}, nil
}

func (d *deviceServer) WatchGpus(_ *deviceapi.WatchGpusRequest, stream deviceapi.GpuService_WatchGpusServer) error {
	w := &watcher{events: make(chan *deviceapi.WatchGpusResponse, watchBuffer), gone: make(chan struct{})}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return status.Error(codes.Unavailable, "shutting down")
	}
	// The snapshot and the subscription are taken under one lock, so no change falls between them.
	initial := d.sorted()
	d.watchers[w] = struct{}{}
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.watchers, w)
		d.mu.Unlock()
	}()
	for _, gpu := range initial {
		if err := stream.Send(&deviceapi.WatchGpusResponse{Type: "ADDED", Object: gpu}); err != nil {
			return err
		}
	}
	for {
		select {
		case ev := <-w.events:
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-w.gone:
			return status.Error(codes.ResourceExhausted, "watch closed: server shutting down or watcher too slow")
		case <-stream.Context().Done():
			return nil
		}
	}
}

func (d *deviceServer) CreateGpu(_ context.Context, in *deviceapi.CreateGpuRequest) (*deviceapi.CreateGpuResponse, error) {
	gpu := in.GetGpu()
	if gpu.GetMetadata().GetName() == "" {
		return nil, status.Error(codes.InvalidArgument, "gpu.metadata.name is empty")
	}
	if gpu.GetSpec().GetUuid() == "" {
		return nil, status.Error(codes.InvalidArgument, "gpu.spec.uuid is empty")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if existing, ok := d.gpus[gpu.Metadata.Name]; ok {
		return &deviceapi.CreateGpuResponse{Gpu: proto.Clone(existing).(*deviceapi.Gpu), Created: false}, nil
	}
	stored := proto.Clone(gpu).(*deviceapi.Gpu)
	if err := d.commit("create", "ADDED", stored); err != nil {
		return nil, err
	}
	d.gpus[stored.Metadata.Name] = stored
	return &deviceapi.CreateGpuResponse{Gpu: proto.Clone(stored).(*deviceapi.Gpu), Created: true}, nil
}

func (d *deviceServer) UpdateGpu(_ context.Context, in *deviceapi.UpdateGpuRequest) (*deviceapi.UpdateGpuResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	current, err := d.lookup(in.GetGpu().GetMetadata().GetName())
	if err != nil {
		return nil, err
	}
	if err := checkVersion(current, in.Gpu.ResourceVersion); err != nil {
		return nil, err
	}
	// NVSentinel documents UpdateGpu as replacing the whole GPU, status included (UpdateGpuStatus is for status).
	next := proto.Clone(in.Gpu).(*deviceapi.Gpu)
	if err := d.commit("update", "MODIFIED", next); err != nil {
		return nil, err
	}
	d.gpus[next.Metadata.Name] = next
	return &deviceapi.UpdateGpuResponse{Gpu: proto.Clone(next).(*deviceapi.Gpu)}, nil
}

func (d *deviceServer) UpdateGpuStatus(_ context.Context, in *deviceapi.UpdateGpuStatusRequest) (*deviceapi.UpdateGpuStatusResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	current, err := d.lookup(in.Name)
	if err != nil {
		return nil, err
	}
	if err := checkVersion(current, in.ResourceVersion); err != nil {
		return nil, err
	}
	next := proto.Clone(current).(*deviceapi.Gpu)
	next.Status = proto.Clone(in.GetStatus()).(*deviceapi.GpuStatus) // the whole status, every provider's conditions
	if in.Status == nil {
		next.Status = nil
	}
	if err := d.commit("update_status", "MODIFIED", next); err != nil {
		return nil, err
	}
	d.gpus[next.Metadata.Name] = next
	return &deviceapi.UpdateGpuStatusResponse{Gpu: proto.Clone(next).(*deviceapi.Gpu)}, nil
}

func (d *deviceServer) DeleteGpu(_ context.Context, in *deviceapi.DeleteGpuRequest) (*emptypb.Empty, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	current, err := d.lookup(in.Name)
	if err != nil {
		return nil, err
	}
	gone := proto.Clone(current).(*deviceapi.Gpu)
	if err := d.commit("delete", "DELETED", gone); err != nil {
		return nil, err
	}
	delete(d.gpus, in.Name)
	return &emptypb.Empty{}, nil
}
