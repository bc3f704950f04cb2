package main

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// pluginHandle is what the kubelet's plugin client hands to the ClientHandler
// (its DevicePlugin interface, identical in every pinned release).
type pluginHandle interface {
	API() pluginapi.DevicePluginClient
	Resource() string
	SocketPath() string
}

type connectEvent struct {
	at      time.Time
	socket  string
	options *pluginapi.DevicePluginOptions
	err     error
}

type disconnectEvent struct {
	at     time.Time
	socket string // empty where the kubelet release does not pass it
}

// recorder is the harness's ClientHandler. It keeps what the kubelet's device manager keeps
// for one resource (ManagerImpl.PluginConnected / PluginDisconnected /
// genericDeviceUpdateCallback): the endpoint and its options, the latest device list, the
// healthy and unhealthy sets, and "all unhealthy" once the last endpoint disconnects.
type recorder struct {
	resource string

	mu          sync.Mutex
	changed     chan struct{}
	connects    []connectEvent
	disconnects []disconnectEvent
	endpoints   map[string]pluginHandle // by socket path
	current     pluginHandle
	options     *pluginapi.DevicePluginOptions
	snapshots   int // ListAndWatch messages received in total
	devices     map[string]*pluginapi.Device
	healthy     map[string]bool
	unhealthy   map[string]bool
	ignored     []string // resources other than ours
	history     []snapRecord
}

// snapRecord is one ListAndWatch message, tagged with the number of successful
// registrations seen before it.
type snapRecord struct {
	at         time.Time
	registered int
	devices    []*pluginapi.Device
}

func newRecorder(resource string) *recorder {
	return &recorder{
		resource:  resource,
		changed:   make(chan struct{}),
		endpoints: map[string]pluginHandle{},
		devices:   map[string]*pluginapi.Device{},
		healthy:   map[string]bool{},
		unhealthy: map[string]bool{},
	}
}

// notify must be called with mu held.
func (r *recorder) notify() {
	close(r.changed)
	r.changed = make(chan struct{})
}

func (r *recorder) connected(ctx context.Context, resource string, p pluginHandle) error {
	if resource != r.resource {
		r.mu.Lock()
		r.ignored = append(r.ignored, resource)
		r.mu.Unlock()
		return fmt.Errorf("harness only accepts %s, got %s", r.resource, resource)
	}
	// Like the kubelet: read the options from the plugin before Register returns.
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	options, err := p.API().GetDevicePluginOptions(cctx, &pluginapi.Empty{})
	r.mu.Lock()
	defer r.mu.Unlock()
	defer r.notify()
	if err != nil {
		err = fmt.Errorf("failed to get device plugin options: %v", err)
		r.connects = append(r.connects, connectEvent{at: time.Now(), socket: p.SocketPath(), err: err})
		return err
	}
	if _, dup := r.endpoints[p.SocketPath()]; dup {
		err = fmt.Errorf("device plugin already connected: %s", p.SocketPath())
		r.connects = append(r.connects, connectEvent{at: time.Now(), socket: p.SocketPath(), err: err})
		return err
	}
	r.endpoints[p.SocketPath()] = p
	r.current = p
	r.options = options
	r.connects = append(r.connects, connectEvent{at: time.Now(), socket: p.SocketPath(), options: options})
	return nil
}

// disconnected handles PluginDisconnected; socket is "" where the release does not pass it
// (then the resource's endpoints are all dropped, as that release's manager does).
func (r *recorder) disconnected(resource, socket string) {
	if resource != r.resource {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	defer r.notify()
	r.disconnects = append(r.disconnects, disconnectEvent{at: time.Now(), socket: socket})
	if socket == "" {
		r.endpoints = map[string]pluginHandle{}
	} else {
		delete(r.endpoints, socket)
	}
	if len(r.endpoints) > 0 {
		for _, p := range r.endpoints {
			r.current = p
			break
		}
		return
	}
	r.current = nil
	// markResourceUnhealthy: every known device becomes unhealthy, allocatable 0.
	for id := range r.healthy {
		r.unhealthy[id] = true
	}
	r.healthy = map[string]bool{}
}

func (r *recorder) listAndWatch(resource string, resp *pluginapi.ListAndWatchResponse) {
	if resource != r.resource {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	defer r.notify()
	r.snapshots++
	registered := 0
	for _, c := range r.connects {
		if c.err == nil {
			registered++
		}
	}
	r.history = append(r.history, snapRecord{at: time.Now(), registered: registered, devices: resp.Devices})
	r.devices = map[string]*pluginapi.Device{}
	r.healthy = map[string]bool{}
	r.unhealthy = map[string]bool{}
	for _, d := range resp.Devices {
		r.devices[d.ID] = d
		if d.Health == pluginapi.Healthy {
			r.healthy[d.ID] = true
		} else {
			r.unhealthy[d.ID] = true
		}
	}
}

// view is a consistent copy of the recorder's state.
type view struct {
	connects    []connectEvent
	disconnects []disconnectEvent
	current     pluginHandle
	options     *pluginapi.DevicePluginOptions
	snapshots   int
	devices     map[string]*pluginapi.Device
	healthy     []string
	unhealthy   []string
	history     []snapRecord
}

// firstAfter returns the first ListAndWatch message received once at least n registrations
// succeeded (a plugin may register more than once in a row, e.g. after a kubelet restart).
func (v view) firstAfter(n int) (snapRecord, bool) {
	for _, s := range v.history {
		if s.registered >= n {
			return s, true
		}
	}
	return snapRecord{}, false
}

func (v view) okConnects() int {
	n := 0
	for _, c := range v.connects {
		if c.err == nil {
			n++
		}
	}
	return n
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func (r *recorder) snapshot() view {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.viewLocked()
}

func (r *recorder) viewLocked() view {
	devs := make(map[string]*pluginapi.Device, len(r.devices))
	for k, v := range r.devices {
		devs[k] = v
	}
	return view{
		connects:    append([]connectEvent(nil), r.connects...),
		disconnects: append([]disconnectEvent(nil), r.disconnects...),
		current:     r.current,
		options:     r.options,
		snapshots:   r.snapshots,
		devices:     devs,
		healthy:     sortedKeys(r.healthy),
		unhealthy:   sortedKeys(r.unhealthy),
		history:     append([]snapRecord(nil), r.history...),
	}
}

// waitFor blocks until cond holds for the recorder's state or the timeout passes.
// It returns the last state seen and whether cond held.
func (r *recorder) waitFor(timeout time.Duration, cond func(view) bool) (view, bool) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		v := r.viewLocked()
		ch := r.changed
		r.mu.Unlock()
		if cond(v) {
			return v, true
		}
		select {
		case <-ch:
		case <-deadline.C:
			return r.snapshot(), cond(r.snapshot())
		}
	}
}
