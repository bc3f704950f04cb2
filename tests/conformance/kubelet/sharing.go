package main

// Scenarios for derived devices, each on a node of its own with a fresh plugin process:
//
//   - shared: time-slicing (4 replicas of every GPU, renamed nvidia.com/gpu.shared) as the
//     kubelet's code sees it: replica IDs, parent health, Allocate naming each GPU once,
//     GetPreferredAllocation spreading replicas;
//   - mig: a mixed-MIG node (GPUs 0 and 1 partitioned), three resources registered at once, each
//     on its own socket; an event in one GPU instance reaching only that MIG device; a kubelet
//     restart re-registering every resource with the latched fault kept.
//
// The Stub serves one fixed resource without replicas or MIG: these are N/A for it.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

var sharingScenarios = []string{
	"shared_registration", "shared_fault", "shared_allocate", "shared_preferred",
	"mig_registration", "mig_instance_fault", "mig_allocate", "mig_kubelet_restart",
}

const (
	sharedResource = "nvidia.com/gpu.shared"
	sharedReplicas = 4
	migSmall       = "nvidia.com/mig-1g.10gb"
	migBig         = "nvidia.com/mig-3g.40gb"
)

// multiRecorder keeps one recorder per resource, as the kubelet's device manager keeps its
// state per resource.
type multiRecorder struct {
	mu   sync.Mutex
	recs map[string]*recorder
}

func newMultiRecorder() *multiRecorder { return &multiRecorder{recs: map[string]*recorder{}} }

func (m *multiRecorder) get(resource string) *recorder {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.recs[resource]
	if !ok {
		r = newRecorder(resource)
		m.recs[resource] = r
	}
	return r
}

func (m *multiRecorder) resources() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []string
	for r := range m.recs {
		out = append(out, r)
	}
	sort.Strings(out)
	return out
}

func (m *multiRecorder) connected(ctx context.Context, resource string, p pluginHandle) error {
	return m.get(resource).connected(ctx, resource, p)
}

func (m *multiRecorder) disconnected(resource, socket string) {
	m.get(resource).disconnected(resource, socket)
}

func (m *multiRecorder) listAndWatch(resource string, resp *pluginapi.ListAndWatchResponse) {
	m.get(resource).listAndWatch(resource, resp)
}

// sink is what the adapters' ClientHandler forwards to: one recorder, or one per resource.
type sink interface {
	connected(ctx context.Context, resource string, p pluginHandle) error
	disconnected(resource, socket string)
	listAndWatch(resource string, resp *pluginapi.ListAndWatchResponse)
}

var (
	_ sink = (*recorder)(nil)
	_ sink = (*multiRecorder)(nil)
)

// runSharingScenarios runs both derived-device nodes for the plugin; track registers what must
// be cleaned up if the harness is interrupted.
func runSharingScenarios(cfg *config, rep *reporter, t target, track func(target, *env)) {
	if _, ok := t.(*pythonPlugin); !ok {
		for _, name := range sharingScenarios {
			rep.na(t, name, "the Stub serves one fixed resource: no time-slicing, no MIG")
		}
		return
	}
	for _, run := range []func(*config, *reporter, func(target, *env)){sharedNode, migNode} {
		func() {
			defer func() {
				if p := recover(); p != nil {
					rep.fail(t, "sharing", "panic: %v", p)
				}
			}()
			run(cfg, rep, track)
		}()
	}
}

func writeJSON(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o644)
}

func healthyIDs(devs []*pluginapi.Device) (healthy, unhealthy []string) {
	for _, d := range devs {
		if d.Health == pluginapi.Healthy {
			healthy = append(healthy, d.ID)
		} else {
			unhealthy = append(unhealthy, d.ID)
		}
	}
	sort.Strings(healthy)
	sort.Strings(unhealthy)
	return healthy, unhealthy
}

func replicaIDs(e *env, indices ...int) []string {
	var out []string
	for _, i := range indices {
		for n := 0; n < sharedReplicas; n++ {
			out = append(out, fmt.Sprintf("%s::%d", e.gpus[i].UUID, n))
		}
	}
	sort.Strings(out)
	return out
}

func parentOf(id string) string { return strings.SplitN(id, "::", 2)[0] }

// ---- time-slicing ----------------------------------------------------------------------------

func sharedNode(cfg *config, rep *reporter, track func(target, *env)) {
	p := &pythonPlugin{cfg: cfg}
	e, err := newEnv(cfg, "shared")
	if err != nil {
		rep.fail(p, "shared_registration", "setup: %v", err)
		return
	}
	track(p, e)
	defer func() { p.cleanup(); e.close() }()
	e.rec = newRecorder(sharedResource)
	conf := filepath.Join(e.dir, "sharing.json")
	if err := writeJSON(conf, map[string]any{"version": "v1", "sharing": map[string]any{"timeSlicing": map[string]any{
		"resources": []map[string]any{{"name": "nvidia.com/gpu", "replicas": sharedReplicas, "rename": sharedResource}},
	}}}); err != nil {
		rep.fail(p, "shared_registration", "config: %v", err)
		return
	}
	e.extraArgs = []string{"--config", conf}
	if err := e.startKubelet(); err != nil {
		rep.fail(p, "shared_registration", "kubelet registration server: %v", err)
		return
	}
	s := &suite{e: e, t: p, rep: rep}

	// Registration: only the renamed resource, 4 replicas per GPU, parent NUMA node, all healthy.
	began := time.Now()
	if err := p.start(e); err != nil {
		rep.fail(p, "shared_registration", "start: %v", err)
		return
	}
	v, snap, ok := e.registered(1, registrationTimeout)
	if !ok {
		rep.fail(p, "shared_registration", "no registration of %s within %s", sharedResource, e.scaled(registrationTimeout))
		return
	}
	s.registrations = v.okConnects()
	var problems []string
	e.rec.mu.Lock()
	if len(e.rec.ignored) > 0 {
		problems = append(problems, fmt.Sprintf("also registered %v (devices: all with a rename moves every GPU)", e.rec.ignored))
	}
	e.rec.mu.Unlock()
	numa := map[string]int64{}
	for _, g := range e.gpus {
		numa[g.UUID] = g.NUMANode
	}
	var ids []string
	for _, d := range snap.devices {
		ids = append(ids, d.ID)
		if len(d.ID) > 63 {
			problems = append(problems, "ID longer than 63 characters: "+d.ID)
		}
		if d.Topology == nil || len(d.Topology.Nodes) != 1 || d.Topology.Nodes[0].ID != numa[parentOf(d.ID)] {
			problems = append(problems, fmt.Sprintf("%s topology %v, want its GPU's NUMA node", d.ID, d.Topology))
		}
		if d.Health != pluginapi.Healthy {
			problems = append(problems, d.ID+" not Healthy")
		}
	}
	sort.Strings(ids)
	if want := replicaIDs(e, 0, 1, 2, 3, 4, 5, 6, 7); strings.Join(ids, ",") != strings.Join(want, ",") {
		problems = append(problems, fmt.Sprintf("%d device IDs %v..., want the %d replica IDs <uuid>::<n>", len(ids), first(ids, 3), len(want)))
	}
	if !rep.check(p, "shared_registration", problems, fmt.Sprintf("registered %s in %.2fs: %d replicas <uuid>::0..%d, parent NUMA, all Healthy",
		sharedResource, snap.at.Sub(began).Seconds(), len(ids), sharedReplicas-1)) {
		return
	}

	// Health: a fault on GPU 2 makes exactly its replicas unhealthy; clearing it heals them.
	wantBad := strings.Join(replicaIDs(e, 2), ",")
	if err := p.setSignals(e, 2, map[string]any{"nvlink_down": []int{0}}); err != nil {
		rep.fail(p, "shared_fault", "inject: %v", err)
	} else if v, ok := e.rec.waitFor(e.scaled(healthTimeout), func(v view) bool {
		return strings.Join(v.unhealthy, ",") == wantBad && len(v.healthy) == 7*sharedReplicas
	}); !ok {
		rep.fail(p, "shared_fault", "unhealthy set %v, want GPU 2's %d replicas", first(v.unhealthy, 6), sharedReplicas)
	} else if err := p.setSignals(e, 2, map[string]any{}); err != nil {
		rep.fail(p, "shared_fault", "clear: %v", err)
	} else if v, ok := e.rec.waitFor(e.scaled(healthTimeout), func(v view) bool {
		return len(v.unhealthy) == 0 && len(v.healthy) == 8*sharedReplicas
	}); !ok {
		rep.fail(p, "shared_fault", "no recovery: unhealthy %v", first(v.unhealthy, 6))
	} else {
		rep.pass(p, "shared_fault", "nvlink_down on GPU 2: exactly its %d replicas unhealthy, all healthy after clearing", sharedReplicas)
	}

	// Allocate: replicas map to their GPUs, each GPU named once.
	api := mustAPI(e)
	ctx, cancel := s.ctx()
	defer cancel()
	problems = nil
	req := []string{e.gpus[1].UUID + "::0", e.gpus[1].UUID + "::3", e.gpus[5].UUID + "::2"}
	resp, err := api.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: req}}})
	if err != nil {
		problems = append(problems, fmt.Sprintf("Allocate(%v): %v", req, err))
	} else if len(resp.ContainerResponses) != 1 {
		problems = append(problems, fmt.Sprintf("%d container responses", len(resp.ContainerResponses)))
	} else {
		if env := resp.ContainerResponses[0].Envs["NVIDIA_VISIBLE_DEVICES"]; len(strings.Split(env, ",")) != 2 {
			problems = append(problems, fmt.Sprintf("NVIDIA_VISIBLE_DEVICES=%q names a GPU more than once", env))
		}
		problems = append(problems, s.allocationProblems(resp.ContainerResponses[0], e.uuids(1, 5))...)
	}
	bad := e.gpus[1].UUID + "::" + fmt.Sprint(sharedReplicas)
	_, err = api.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{bad}}}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), bad) {
		problems = append(problems, fmt.Sprintf("replica %s beyond the count: got %v, want InvalidArgument naming it", bad, err))
	}
	rep.check(p, "shared_allocate", problems, "3 replicas of GPUs 1 and 5: NVIDIA_VISIBLE_DEVICES names each GPU once, device specs for both; replica ::4 rejected")

	// GetPreferredAllocation: the default policy spreads replicas over GPUs.
	problems = nil
	all := replicaIDs(e, 0, 1, 2, 3, 4, 5, 6, 7)
	pref, err := api.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
		AvailableDeviceIDs: all, MustIncludeDeviceIDs: []string{e.gpus[3].UUID + "::1"}, AllocationSize: 3}}})
	var got []string
	if err != nil || len(pref.ContainerResponses) != 1 {
		problems = append(problems, fmt.Sprintf("GetPreferredAllocation: %v", err))
	} else {
		got = pref.ContainerResponses[0].DeviceIDs
		parents := map[string]bool{}
		for _, id := range got {
			parents[parentOf(id)] = true
			if !contains(all, id) {
				problems = append(problems, id+" not among the available")
			}
		}
		if len(got) != 3 || !contains(got, e.gpus[3].UUID+"::1") {
			problems = append(problems, fmt.Sprintf("answer %v: want 3 including GPU 3's replica 1", got))
		}
		if len(parents) != 3 {
			problems = append(problems, fmt.Sprintf("answer %v uses %d GPUs, want 3 (distributed)", got, len(parents)))
		}
	}
	rep.check(p, "shared_preferred", problems, fmt.Sprintf("size 3 with a must-include: 3 replicas on 3 GPUs (%d answer IDs)", len(got)))
	if _, err := p.shutdown(e); err != nil {
		rep.fail(p, "shared_preferred", "shutdown: %v", err)
	}
}

func first(ids []string, n int) []string {
	if len(ids) > n {
		return ids[:n]
	}
	return ids
}

// ---- mixed MIG -------------------------------------------------------------------------------

func migGPUs() []gpu {
	gpus := defaultGPUs()
	for i := 0; i < 2; i++ {
		mk := func(k, gi int, profile string, mem int) migDevice {
			return migDevice{UUID: fmt.Sprintf("MIG-6b0c9a1e-3f2d-4c5b-8a79-%012x", 0xfeed000+16*i+k),
				GPUInstanceID: gi, Profile: profile, MemoryMiB: mem}
		}
		gpus[i].MigDevices = []migDevice{mk(0, 7, "1g.10gb", 9856), mk(1, 8, "1g.10gb", 9856), mk(2, 2, "3g.40gb", 40192)}
	}
	return gpus
}

func migIDs(gpus []gpu, profile string) []string {
	var out []string
	for _, g := range gpus {
		for _, m := range g.MigDevices {
			if m.Profile == profile {
				out = append(out, m.UUID)
			}
		}
	}
	sort.Strings(out)
	return out
}

func migNode(cfg *config, rep *reporter, track func(target, *env)) {
	p := &pythonPlugin{cfg: cfg}
	e, err := newEnv(cfg, "mig")
	if err != nil {
		rep.fail(p, "mig_registration", "setup: %v", err)
		return
	}
	track(p, e)
	defer func() { p.cleanup(); e.close() }()
	e.gpus = migGPUs()
	if err := writeNodeFile(e.nodeFile, e.gpus); err != nil {
		rep.fail(p, "mig_registration", "node file: %v", err)
		return
	}
	m := newMultiRecorder()
	e.handler = m
	e.extraArgs = []string{"--mig-strategy", "mixed"}
	if err := e.startKubelet(); err != nil {
		rep.fail(p, "mig_registration", "kubelet registration server: %v", err)
		return
	}
	want := map[string][]string{
		"nvidia.com/gpu": e.uuids(2, 3, 4, 5, 6, 7),
		migSmall:         migIDs(e.gpus, "1g.10gb"),
		migBig:           migIDs(e.gpus, "3g.40gb"),
	}
	sort.Strings(want["nvidia.com/gpu"])
	names := []string{"nvidia.com/gpu", migSmall, migBig}
	wait := func(timeout time.Duration, cond func(res string, v view) bool) (map[string]view, bool) {
		out := map[string]view{}
		all := true
		for _, res := range names {
			v, ok := m.get(res).waitFor(e.scaled(timeout), func(v view) bool { return cond(res, v) })
			out[res] = v
			all = all && ok
		}
		return out, all
	}

	began := time.Now()
	if err := p.start(e); err != nil {
		rep.fail(p, "mig_registration", "start: %v", err)
		return
	}
	views, ok := wait(registrationTimeout, func(_ string, v view) bool { return v.current != nil && v.snapshots > 0 })
	if !ok {
		rep.fail(p, "mig_registration", "not every resource registered within %s (seen: %v)", e.scaled(registrationTimeout), m.resources())
		return
	}
	var problems []string
	sockets := map[string]bool{}
	for _, res := range names {
		v := views[res]
		sockets[v.current.SocketPath()] = true
		if v.options == nil || !v.options.GetPreferredAllocationAvailable {
			problems = append(problems, res+": options not read or GetPreferredAllocationAvailable false")
		}
		healthy, unhealthy := healthyIDs(v.history[len(v.history)-1].devices)
		if strings.Join(healthy, ",") != strings.Join(want[res], ",") || len(unhealthy) > 0 {
			problems = append(problems, fmt.Sprintf("%s: healthy %v unhealthy %v, want %v", res, healthy, unhealthy, want[res]))
		}
		for _, d := range v.history[len(v.history)-1].devices {
			if d.Topology == nil || len(d.Topology.Nodes) != 1 {
				problems = append(problems, fmt.Sprintf("%s: %s without one NUMA node", res, d.ID))
			}
		}
	}
	if len(sockets) != len(names) {
		problems = append(problems, fmt.Sprintf("%d sockets for %d resources", len(sockets), len(names)))
	}
	if extra := len(m.resources()) - len(names); extra > 0 {
		problems = append(problems, fmt.Sprintf("unexpected resources registered: %v", m.resources()))
	}
	if !rep.check(p, "mig_registration", problems, fmt.Sprintf("3 resources on 3 sockets in %.2fs: nvidia.com/gpu 6 GPUs, %s 4, %s 2",
		time.Since(began).Seconds(), migSmall, migBig)) {
		return
	}

	// An XID in GPU instance 7 of GPU 1 reaches only that MIG device.
	smallBad := e.gpus[1].MigDevices[0].UUID
	problems = nil
	if err := p.setSignals(e, 1, map[string]any{"mig_events": []map[string]int{{"gpu_instance_id": 7, "xid": 79}}}); err != nil {
		rep.fail(p, "mig_instance_fault", "inject: %v", err)
		return
	}
	views, ok = wait(healthTimeout, func(res string, v view) bool {
		if res == migSmall {
			return strings.Join(v.unhealthy, ",") == smallBad && len(v.healthy) == 3
		}
		return len(v.unhealthy) == 0 && len(v.healthy) == len(want[res])
	})
	if !ok {
		for _, res := range names {
			problems = append(problems, fmt.Sprintf("%s unhealthy %v", res, views[res].unhealthy))
		}
		problems = append(problems, "want only "+smallBad)
	}
	rep.check(p, "mig_instance_fault", problems, "XID 79 in GPU instance 7 of GPU 1: only its 1g.10gb device unhealthy, the 3g.40gb slice and whole GPUs healthy")

	// Allocate a MIG device through its resource's client.
	s := &suite{e: e, t: p, rep: rep}
	ctx, cancel := s.ctx()
	defer cancel()
	problems = nil
	big := m.get(migBig).snapshot().current.API()
	id := e.gpus[0].MigDevices[2].UUID
	resp, err := big.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{id}}}})
	if err != nil || len(resp.ContainerResponses) != 1 {
		problems = append(problems, fmt.Sprintf("Allocate(%s): %v", id, err))
	} else {
		c := resp.ContainerResponses[0]
		if got := c.Envs["NVIDIA_VISIBLE_DEVICES"]; got != id {
			problems = append(problems, fmt.Sprintf("NVIDIA_VISIBLE_DEVICES=%q, want the MIG UUID %s", got, id))
		}
		paths := map[string]string{}
		for _, d := range c.Devices {
			paths[d.ContainerPath] = d.HostPath
		}
		for _, pth := range []string{"/dev/nvidia0", "/dev/nvidiactl"} {
			if paths[pth] != filepath.Join(e.devRoot, pth) {
				problems = append(problems, fmt.Sprintf("device spec %s: host path %q", pth, paths[pth]))
			}
		}
	}
	_, err = big.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: e.uuids(4)}}})
	if status.Code(err) != codes.InvalidArgument {
		problems = append(problems, fmt.Sprintf("a whole GPU through %s: got %v, want InvalidArgument", migBig, err))
	}
	rep.check(p, "mig_allocate", problems, "MIG UUID in NVIDIA_VISIBLE_DEVICES, the parent's /dev/nvidia0; a whole GPU refused by the MIG resource")

	// Kubelet restart: every resource registers again, the latched MIG fault is kept.
	before := map[string]int{}
	for _, res := range names {
		v := m.get(res).snapshot()
		before[res] = v.okConnects()
		before[res+"/disconnects"] = len(v.disconnects)
	}
	if err := e.stopKubelet(); err != nil {
		rep.fail(p, "mig_kubelet_restart", "server Stop: %v", err)
		return
	}
	if _, ok := wait(5*time.Second, func(res string, v view) bool { return len(v.disconnects) > before[res+"/disconnects"] }); !ok {
		rep.fail(p, "mig_kubelet_restart", "stopping the server did not disconnect every resource")
		return
	}
	time.Sleep(time.Second)
	restarted := time.Now()
	if err := e.startKubelet(); err != nil {
		rep.fail(p, "mig_kubelet_restart", "restart: %v", err)
		return
	}
	views, ok = wait(registrationTimeout, func(res string, v view) bool {
		_, got := v.firstAfter(before[res] + 1)
		return got && v.current != nil
	})
	if !ok {
		rep.fail(p, "mig_kubelet_restart", "not every resource re-registered within %s", e.scaled(registrationTimeout))
		return
	}
	took := time.Since(restarted)
	time.Sleep(e.scaled(time.Second)) // an old stream ending late must not take a new registration down
	problems = nil
	for _, res := range names {
		v := m.get(res).snapshot()
		if v.current == nil {
			problems = append(problems, res+" disconnected within 1s of re-registering")
		}
		if n := v.okConnects() - before[res]; n > 2 {
			problems = append(problems, fmt.Sprintf("%s registered %d times for one restart", res, n))
		}
		snap, _ := views[res].firstAfter(before[res] + 1)
		_, unhealthy := healthyIDs(snap.devices)
		wantBad := ""
		if res == migSmall {
			wantBad = smallBad
		}
		if strings.Join(unhealthy, ",") != wantBad || len(snap.devices) != len(want[res]) {
			problems = append(problems, fmt.Sprintf("%s first snapshot after restart: %d devices, unhealthy %v, want %d and [%s]",
				res, len(snap.devices), unhealthy, len(want[res]), wantBad))
		}
	}
	rep.check(p, "mig_kubelet_restart", problems, fmt.Sprintf("all 3 resources re-registered within %.0f ms, latched MIG fault kept", ms(took)))
	if _, err := p.shutdown(e); err != nil {
		rep.fail(p, "mig_kubelet_restart", "shutdown: %v", err)
	}
}
