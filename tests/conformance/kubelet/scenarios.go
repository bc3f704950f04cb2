package main

import (
	"context"
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

// reporter prints one line per result: "PASS target/name - detail", "FAIL target/name: reason"
// or "N/A target/name: reason", and counts them.
type reporter struct {
	mu                   sync.Mutex
	passed, failed, skip int
}

func (r *reporter) pass(t target, name, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.passed++
	detail := fmt.Sprintf(format, args...)
	if detail != "" {
		detail = " - " + detail
	}
	fmt.Printf("PASS %s/%s%s\n", t.name(), name, detail)
}

func (r *reporter) fail(t target, name, format string, args ...any) {
	r.mu.Lock()
	r.failed++
	fmt.Printf("FAIL %s/%s: %s\n", t.name(), name, oneLine(fmt.Sprintf(format, args...)))
	r.mu.Unlock()
	if d := t.diagnostics(); d != "" {
		fmt.Fprintln(os.Stderr, d)
	}
}

func (r *reporter) na(t target, name, format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.skip++
	fmt.Printf("N/A %s/%s: %s\n", t.name(), name, fmt.Sprintf(format, args...))
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// check turns a list of problems into a result.
func (r *reporter) check(t target, name string, problems []string, detail string) bool {
	if len(problems) > 0 {
		r.fail(t, name, "%s", strings.Join(problems, "; "))
		return false
	}
	r.pass(t, name, "%s", detail)
	return true
}

const (
	registrationTimeout = 30 * time.Second
	healthTimeout       = 10 * time.Second
	rpcTimeout          = 10 * time.Second
)

type suite struct {
	e   *env
	t   target
	rep *reporter
	// registrations counts successful registrations the scenarios have waited for.
	registrations int
}

func (s *suite) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), s.e.scaled(rpcTimeout))
}

func (s *suite) run() {
	steps := []struct {
		name string
		fn   func() bool
	}{
		{"registration", s.registration},
		{"fault_recovery", s.faultRecovery},
		{"allocate", s.allocate},
		{"allocate_invalid_ids", s.allocateInvalid},
		{"preferred_allocation", s.preferredAllocation},
		{"kubelet_restart", s.kubeletRestart},
		{"plugin_kill", s.pluginKill},
		{"concurrent_allocate", s.concurrentAllocate},
		{"shutdown", s.shutdown},
	}
	for _, step := range steps {
		func() {
			defer func() {
				if p := recover(); p != nil {
					s.rep.fail(s.t, step.name, "panic: %v", p)
				}
			}()
			step.fn()
		}()
	}
}

// deviceProblems compares a ListAndWatch message with the node file.
func (s *suite) deviceProblems(devs []*pluginapi.Device, unhealthy map[int]bool) []string {
	var problems []string
	want := expectedDevices(s.e.gpus, unhealthy)
	got := map[string]*pluginapi.Device{}
	for _, d := range devs {
		if _, dup := got[d.ID]; dup {
			problems = append(problems, fmt.Sprintf("device %s listed twice", d.ID))
		}
		got[d.ID] = d
	}
	for _, w := range want {
		g, ok := got[w.ID]
		if !ok {
			problems = append(problems, fmt.Sprintf("device %s missing", w.ID))
			continue
		}
		if g.Health != w.Health {
			problems = append(problems, fmt.Sprintf("GPU %d health %q, want %q", s.e.indexOf(w.ID), g.Health, w.Health))
		}
		var nodes []int64
		if g.Topology != nil {
			for _, n := range g.Topology.Nodes {
				nodes = append(nodes, n.ID)
			}
		}
		if len(nodes) != 1 || nodes[0] != w.Topology.Nodes[0].ID {
			problems = append(problems, fmt.Sprintf("GPU %d topology NUMA nodes %v, want [%d]", s.e.indexOf(w.ID), nodes, w.Topology.Nodes[0].ID))
		}
		if len(g.ID) > 63 {
			problems = append(problems, fmt.Sprintf("device ID %s longer than 63 characters", g.ID))
		}
	}
	if len(got) != len(want) {
		problems = append(problems, fmt.Sprintf("%d devices, want %d", len(got), len(want)))
	}
	return problems
}

func (s *suite) healthIs(unhealthy ...int) func(view) bool {
	wantBad := s.e.uuids(unhealthy...)
	sort.Strings(wantBad)
	return func(v view) bool {
		return v.current != nil && len(v.healthy)+len(v.unhealthy) == len(s.e.gpus) &&
			strings.Join(v.unhealthy, ",") == strings.Join(wantBad, ",")
	}
}

func (s *suite) indices(ids []string) []int {
	out := make([]int, len(ids))
	for i, id := range ids {
		out[i] = s.e.indexOf(id)
	}
	sort.Ints(out)
	return out
}

// settle checks that a fresh registration holds: the plugin stays connected for a while (an
// old stream ending late must not take the new registration down, the race the kubelet only
// fixed in 1.37) and it does not keep re-registering. It returns the registrations counted.
func (s *suite) settle(since int) (int, []string) {
	time.Sleep(s.e.scaled(time.Second))
	v := s.e.rec.snapshot()
	var problems []string
	if v.current == nil {
		problems = append(problems, "registered, then disconnected within 1s (old stream ending after the new registration?)")
	}
	n := v.okConnects()
	if n-since > 2 {
		problems = append(problems, fmt.Sprintf("%d registrations for one restart", n-since))
	}
	s.registrations = n
	return n - since, problems
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return fmt.Sprintf(many, n)
}

func (s *suite) needRegistered(name string) bool {
	if s.e.rec.snapshot().current == nil || s.registrations == 0 {
		s.rep.fail(s.t, name, "not run: no plugin registered")
		return false
	}
	return true
}

// ---- scenarios -----------------------------------------------------------------------------

func (s *suite) registration() bool {
	const name = "registration"
	began := time.Now()
	if err := s.t.start(s.e); err != nil {
		s.rep.fail(s.t, name, "start: %v", err)
		return false
	}
	v, snap, ok := s.e.registered(1, registrationTimeout)
	if !ok {
		s.rep.fail(s.t, name, "no registration with a ListAndWatch message within %s (registrations: %d, failed: %d, messages: %d)",
			s.e.scaled(registrationTimeout), v.okConnects(), len(v.connects)-v.okConnects(), v.snapshots)
		return false
	}
	s.registrations = v.okConnects()
	var problems []string
	for _, c := range v.connects {
		if c.err != nil {
			problems = append(problems, "rejected registration: "+c.err.Error())
		}
	}
	if o := v.options; o == nil {
		problems = append(problems, "no options read")
	} else {
		if !o.GetPreferredAllocationAvailable {
			problems = append(problems, "GetPreferredAllocationAvailable is false")
		}
		if o.PreStartRequired {
			problems = append(problems, "PreStartRequired is true")
		}
	}
	sock := v.current.SocketPath()
	if filepath.Dir(sock)+"/" != s.e.pluginDir || filepath.Base(sock) == kubeletSocketName {
		problems = append(problems, "endpoint "+sock+" is not a socket of its own in the plugin dir")
	}
	if v.current.Resource() != s.e.cfg.resource {
		problems = append(problems, "resource "+v.current.Resource())
	}
	problems = append(problems, s.deviceProblems(snap.devices, nil)...)
	return s.rep.check(s.t, name, problems, fmt.Sprintf("registered in %.2fs as %s, endpoint %s, %d devices, first snapshot matches node file",
		snap.at.Sub(began).Seconds(), v.current.Resource(), filepath.Base(sock), len(snap.devices)))
}

func (s *suite) faultRecovery() bool {
	const name = "fault_recovery"
	if !s.needRegistered(name) {
		return false
	}
	began := time.Now()
	if err := s.t.setSignals(s.e, 2, map[string]any{"nvlink_down": []int{0}}); err != nil {
		s.rep.fail(s.t, name, "inject: %v", err)
		return false
	}
	v, ok := s.e.rec.waitFor(s.e.scaled(healthTimeout), s.healthIs(2))
	if !ok {
		s.rep.fail(s.t, name, "GPU 2 not the only unhealthy device after fault (unhealthy %v)", s.indices(v.unhealthy))
		return false
	}
	faultAt := time.Since(began)

	// The kubelet only picks healthy devices, but health can change between its choice and
	// the call: the plugin rejects an allocation of a device it reports unhealthy.
	if s.t.persistsHealth() {
		ctx, cancel := s.ctx()
		_, err := mustAPI(s.e).Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: s.e.uuids(2)}}})
		cancel()
		if status.Code(err) != codes.FailedPrecondition {
			s.rep.fail(s.t, "allocate_unhealthy", "Allocate of unhealthy GPU 2: got %v, want FailedPrecondition", err)
		} else {
			s.rep.pass(s.t, "allocate_unhealthy", "FailedPrecondition: %s", status.Convert(err).Message())
		}
	} else {
		s.rep.na(s.t, "allocate_unhealthy", "the Stub's Allocate sees only its construction-time device list")
	}

	began = time.Now()
	if err := s.t.setSignals(s.e, 2, map[string]any{}); err != nil {
		s.rep.fail(s.t, name, "clear: %v", err)
		return false
	}
	v, ok = s.e.rec.waitFor(s.e.scaled(healthTimeout), s.healthIs())
	if !ok {
		s.rep.fail(s.t, name, "no recovery within %s after clearing the fault (unhealthy %v)", s.e.scaled(healthTimeout), s.indices(v.unhealthy))
		return false
	}
	how := "node file signals"
	if !s.t.persistsHealth() {
		how = "Stub.Update"
	}
	return s.rep.check(s.t, name, nil, fmt.Sprintf("via %s: unhealthy set {2} after %.0f ms, all healthy again %.0f ms after clearing",
		how, ms(faultAt), ms(time.Since(began))))
}

func mustAPI(e *env) pluginapi.DevicePluginClient {
	c, err := e.api()
	if err != nil {
		panic(err)
	}
	return c
}

// allocationProblems checks one container's response for the given GPUs.
func (s *suite) allocationProblems(resp *pluginapi.ContainerAllocateResponse, ids []string) []string {
	var problems []string
	env := resp.GetEnvs()["NVIDIA_VISIBLE_DEVICES"]
	got := strings.Split(env, ",")
	sort.Strings(got)
	want := append([]string(nil), ids...)
	sort.Strings(want)
	if strings.Join(got, ",") != strings.Join(want, ",") {
		problems = append(problems, fmt.Sprintf("NVIDIA_VISIBLE_DEVICES=%q, want the UUIDs %v", env, ids))
	}
	specs := map[string]*pluginapi.DeviceSpec{}
	for _, d := range resp.GetDevices() {
		specs[d.ContainerPath] = d
		if d.Permissions == "" || strings.Trim(d.Permissions, "rwm") != "" {
			problems = append(problems, fmt.Sprintf("%s permissions %q", d.ContainerPath, d.Permissions))
		}
	}
	wantPaths := []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
	for _, id := range ids {
		wantPaths = append(wantPaths, fmt.Sprintf("/dev/nvidia%d", s.e.indexOf(id)))
	}
	for _, p := range wantPaths {
		d, ok := specs[p]
		if !ok {
			problems = append(problems, "no device spec for "+p)
			continue
		}
		if wantHost := filepath.Join(s.e.devRoot, p); d.HostPath != wantHost {
			problems = append(problems, fmt.Sprintf("%s host_path %s, want %s", p, d.HostPath, wantHost))
		}
	}
	for _, g := range s.e.gpus {
		p := fmt.Sprintf("/dev/nvidia%d", g.Index)
		if _, ok := specs[p]; ok && !contains(wantPaths, p) {
			problems = append(problems, "device spec for unallocated "+p)
		}
	}
	return problems
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func (s *suite) allocate() bool {
	const name = "allocate"
	if !s.needRegistered(name) {
		return false
	}
	api := mustAPI(s.e)
	ctx, cancel := s.ctx()
	defer cancel()
	var problems []string
	ids := s.e.uuids(0, 1)
	resp, err := api.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: ids}}})
	if err != nil {
		s.rep.fail(s.t, name, "Allocate(GPU 0,1): %v", err)
		return false
	}
	if n := len(resp.ContainerResponses); n != 1 {
		problems = append(problems, fmt.Sprintf("%d container responses for 1 request", n))
	} else {
		problems = append(problems, s.allocationProblems(resp.ContainerResponses[0], ids)...)
	}
	// One ContainerAllocateRequest per container: one response each, in order.
	resp, err = api.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{
		{DevicesIds: s.e.uuids(2)}, {DevicesIds: s.e.uuids(5, 6)}}})
	if err != nil {
		problems = append(problems, fmt.Sprintf("Allocate with 2 containers: %v", err))
	} else if n := len(resp.ContainerResponses); n != 2 {
		problems = append(problems, fmt.Sprintf("%d container responses for 2 requests", n))
	} else {
		problems = append(problems, s.allocationProblems(resp.ContainerResponses[0], s.e.uuids(2))...)
		problems = append(problems, s.allocationProblems(resp.ContainerResponses[1], s.e.uuids(5, 6))...)
	}
	return s.rep.check(s.t, name, problems, "NVIDIA_VISIBLE_DEVICES and device specs right for 1 and 2 containers")
}

func (s *suite) allocateInvalid() bool {
	const name = "allocate_invalid_ids"
	if !s.needRegistered(name) {
		return false
	}
	api := mustAPI(s.e)
	ctx, cancel := s.ctx()
	defer cancel()
	var problems []string
	unknown := "GPU-00000000-0000-4000-8000-00000000dead"
	for _, tc := range []struct {
		what string
		ids  []string
		must string
	}{
		{"unknown ID", []string{s.e.gpus[0].UUID, unknown}, unknown},
		{"duplicate ID", s.e.uuids(1, 1), s.e.gpus[1].UUID},
	} {
		_, err := api.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: tc.ids}}})
		switch {
		case err == nil:
			problems = append(problems, tc.what+" accepted")
		case status.Code(err) != codes.InvalidArgument:
			problems = append(problems, fmt.Sprintf("%s: code %s, want InvalidArgument (%v)", tc.what, status.Code(err), err))
		case !strings.Contains(status.Convert(err).Message(), tc.must):
			problems = append(problems, fmt.Sprintf("%s: message %q does not name %s", tc.what, status.Convert(err).Message(), tc.must))
		}
	}
	return s.rep.check(s.t, name, problems, "unknown and duplicate IDs rejected with InvalidArgument naming the ID")
}

func (s *suite) preferredAllocation() bool {
	const name = "preferred_allocation"
	if !s.needRegistered(name) {
		return false
	}
	api := mustAPI(s.e)
	ctx, cancel := s.ctx()
	defer cancel()
	all := []int{0, 1, 2, 3, 4, 5, 6, 7}
	cases := []struct {
		what      string
		available []int
		must      []int
		size      int32
		// ok judges the chosen indices (sorted).
		ok   func([]int) bool
		want string
	}{
		{"size 4 must-include 0", all, []int{0}, 4, eqInts(0, 1, 2, 3), "{0,1,2,3}"},
		{"size 2 must-include 5", all, []int{5}, 2, func(c []int) bool {
			return len(c) == 2 && containsInt(c, 5) && nvlinkIsland(c[0]) == 1 && nvlinkIsland(c[1]) == 1
		}, "5 and a partner in {4,6,7}"},
		{"size 3 from {1,2,5,6,7}", []int{1, 2, 5, 6, 7}, nil, 3, eqInts(5, 6, 7), "{5,6,7}"},
		{"size 2 from {0,4,5}", []int{0, 4, 5}, nil, 2, eqInts(4, 5), "{4,5}"},
		{"size 8 must-include 7", all, []int{7}, 8, eqInts(all...), "all 8"},
	}
	var problems []string
	var answers []string
	for _, tc := range cases {
		req := &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
			AvailableDeviceIDs:   s.e.uuids(tc.available...),
			MustIncludeDeviceIDs: s.e.uuids(tc.must...),
			AllocationSize:       tc.size,
		}}}
		resp, err := api.GetPreferredAllocation(ctx, req)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", tc.what, err))
			continue
		}
		if len(resp.ContainerResponses) != 1 {
			problems = append(problems, fmt.Sprintf("%s: %d container responses", tc.what, len(resp.ContainerResponses)))
			continue
		}
		ids := resp.ContainerResponses[0].DeviceIDs
		chosen := s.indices(ids)
		answers = append(answers, fmt.Sprintf("%v", chosen))
		seen := map[int]bool{}
		for _, c := range chosen {
			if seen[c] {
				problems = append(problems, fmt.Sprintf("%s: GPU %d twice", tc.what, c))
			}
			seen[c] = true
			if c < 0 || !containsInt(tc.available, c) {
				problems = append(problems, fmt.Sprintf("%s: answer %v outside available", tc.what, chosen))
				break
			}
		}
		for _, m := range tc.must {
			if !seen[m] {
				problems = append(problems, fmt.Sprintf("%s: must-include GPU %d missing from %v", tc.what, m, chosen))
			}
		}
		if !tc.ok(chosen) {
			problems = append(problems, fmt.Sprintf("%s: got %v, want %s", tc.what, chosen, tc.want))
		}
	}
	return s.rep.check(s.t, name, problems, "answers "+strings.Join(answers, " "))
}

func eqInts(want ...int) func([]int) bool {
	return func(got []int) bool { return fmt.Sprint(got) == fmt.Sprint(want) }
}

func containsInt(list []int, x int) bool {
	for _, v := range list {
		if v == x {
			return true
		}
	}
	return false
}

// latch puts a latched fault (XID 79) on GPU 3 and clears the signal; GPU 3 must stay
// unhealthy. Returns false (after reporting) when that fails.
func (s *suite) latch(name string) bool {
	if err := s.t.setSignals(s.e, 3, map[string]any{"xid_events": []int{79}}); err != nil {
		s.rep.fail(s.t, name, "inject XID 79: %v", err)
		return false
	}
	if v, ok := s.e.rec.waitFor(s.e.scaled(healthTimeout), s.healthIs(3)); !ok {
		s.rep.fail(s.t, name, "GPU 3 not unhealthy after XID 79 (unhealthy %v)", s.indices(v.unhealthy))
		return false
	}
	if err := s.t.setSignals(s.e, 3, map[string]any{}); err != nil {
		s.rep.fail(s.t, name, "clear XID list: %v", err)
		return false
	}
	// Several clean polls: a recoverable fault would have cleared by now.
	time.Sleep(s.e.scaled(1500 * time.Millisecond))
	if v := s.e.rec.snapshot(); !s.healthIs(3)(v) {
		s.rep.fail(s.t, name, "XID 79 fault did not latch: unhealthy %v after the XID list was emptied", s.indices(v.unhealthy))
		return false
	}
	return true
}

func (s *suite) kubeletRestart() bool {
	const name = "kubelet_restart"
	if !s.needRegistered(name) {
		return false
	}
	latched := false
	if s.t.persistsHealth() {
		if !s.latch(name) {
			return false
		}
		latched = true
	}
	before := s.e.rec.snapshot()
	oldSocket := before.current.SocketPath()
	if err := s.e.stopKubelet(); err != nil {
		s.rep.fail(s.t, name, "server Stop: %v", err)
		return false
	}
	if v, ok := s.e.rec.waitFor(s.e.scaled(5*time.Second), func(v view) bool { return len(v.disconnects) > len(before.disconnects) }); !ok {
		s.rep.fail(s.t, name, "stopping the server did not disconnect the plugin (%d disconnects)", len(v.disconnects))
		return false
	}
	time.Sleep(time.Second) // the kubelet is down for a moment
	began := time.Now()
	if err := s.e.startKubelet(); err != nil { // wipes the sockets, creates kubelet.sock
		s.rep.fail(s.t, name, "restart: %v", err)
		return false
	}
	var problems []string
	if _, err := os.Stat(oldSocket); err == nil && oldSocket != s.e.kubeletSock {
		problems = append(problems, "old plugin socket survived the restart wipe")
	}
	if err := s.t.afterKubeletRestart(s.e); err != nil {
		s.rep.fail(s.t, name, "re-register: %v", err)
		return false
	}
	v, snap, ok := s.e.registered(s.registrations+1, registrationTimeout)
	if !ok {
		s.rep.fail(s.t, name, "no re-registration within %s of the kubelet restart", s.e.scaled(registrationTimeout))
		return false
	}
	if v.current.SocketPath() == s.e.kubeletSock {
		problems = append(problems, "plugin registered kubelet.sock as its endpoint")
	}
	count, settleProblems := s.settle(before.okConnects())
	problems = append(problems, settleProblems...)
	detail := fmt.Sprintf("re-registered %.0f ms after the new server started (%s), endpoint %s",
		ms(snap.at.Sub(began)), plural(count, "1 registration", "%d registrations"), filepath.Base(v.current.SocketPath()))
	if !s.t.persistsHealth() {
		detail += " (the harness re-registers the Stub, as Stub.Watch would)"
	}
	ok = s.rep.check(s.t, name, problems, detail)

	const kept = "kubelet_restart_health_kept"
	if !latched {
		s.rep.na(s.t, kept, "the Stub resends its construction-time device list (no health persistence)")
		return ok
	}
	s.rep.check(s.t, kept, s.deviceProblems(snap.devices, map[int]bool{3: true}),
		"first snapshot after re-registration: latched GPU 3 still Unhealthy, others Healthy")
	return ok
}

func (s *suite) pluginKill() bool {
	const name = "plugin_kill"
	if !s.needRegistered(name) {
		return false
	}
	before := s.e.rec.snapshot()
	began := time.Now()
	if err := s.t.kill(s.e); err != nil {
		s.rep.fail(s.t, name, "kill: %v", err)
		return false
	}
	v, ok := s.e.rec.waitFor(s.e.scaled(10*time.Second), func(v view) bool {
		return len(v.disconnects) > len(before.disconnects) && v.current == nil
	})
	if !ok {
		s.rep.fail(s.t, name, "the kubelet code saw no disconnect within %s", s.e.scaled(10*time.Second))
		return false
	}
	how := "SIGKILL"
	if !s.t.persistsHealth() {
		how = "Stub.Stop"
	}
	var problems []string
	if len(v.healthy) != 0 {
		problems = append(problems, fmt.Sprintf("%d devices still healthy after disconnect", len(v.healthy)))
	}
	s.rep.check(s.t, name, problems, fmt.Sprintf("%s: disconnect seen after %.0f ms, all devices unhealthy", how, ms(v.disconnects[len(v.disconnects)-1].at.Sub(began))))

	const back = "plugin_restart"
	began = time.Now()
	if err := s.t.restart(s.e); err != nil {
		s.rep.fail(s.t, back, "restart: %v", err)
		return false
	}
	v, snap, ok := s.e.registered(s.registrations+1, registrationTimeout)
	if !ok {
		s.rep.fail(s.t, back, "no registration within %s of the restart", s.e.scaled(registrationTimeout))
		return false
	}
	count, problems := s.settle(before.okConnects())
	s.rep.check(s.t, back, problems, fmt.Sprintf("registered again %.2fs after start (%s), endpoint %s",
		snap.at.Sub(began).Seconds(), plural(count, "1 registration", "%d registrations"), filepath.Base(v.current.SocketPath())))

	const kept = "plugin_restart_latched_kept"
	if !s.t.persistsHealth() {
		s.rep.na(s.t, kept, "the Stub has no state directory")
		return true
	}
	return s.rep.check(s.t, kept, s.deviceProblems(snap.devices, map[int]bool{3: true}),
		"same state dir: latched GPU 3 Unhealthy in the first snapshot, others Healthy")
}

func (s *suite) concurrentAllocate() bool {
	const name = "concurrent_allocate"
	const callers = 64
	if !s.needRegistered(name) {
		return false
	}
	v := s.e.rec.snapshot()
	if len(v.healthy) == 0 {
		s.rep.fail(s.t, name, "no healthy devices")
		return false
	}
	api := v.current.API()
	ctx, cancel := context.WithTimeout(context.Background(), s.e.scaled(30*time.Second))
	defer cancel()
	start := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	var problems []string
	var slowest time.Duration
	for i := 0; i < callers; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			id := v.healthy[i%len(v.healthy)]
			<-start
			t0 := time.Now()
			resp, err := api.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{id}}}})
			d := time.Since(t0)
			mu.Lock()
			defer mu.Unlock()
			if d > slowest {
				slowest = d
			}
			switch {
			case err != nil:
				problems = append(problems, fmt.Sprintf("call %d: %v", i, err))
			case len(resp.ContainerResponses) != 1:
				problems = append(problems, fmt.Sprintf("call %d: %d responses", i, len(resp.ContainerResponses)))
			case resp.ContainerResponses[0].Envs["NVIDIA_VISIBLE_DEVICES"] != id:
				problems = append(problems, fmt.Sprintf("call %d: NVIDIA_VISIBLE_DEVICES=%q, want %s", i, resp.ContainerResponses[0].Envs["NVIDIA_VISIBLE_DEVICES"], id))
			}
		}(i)
	}
	began := time.Now()
	close(start)
	wg.Wait()
	wall := time.Since(began)
	if len(problems) > 5 {
		problems = append(problems[:5], fmt.Sprintf("... %d failures in all", len(problems)))
	}
	return s.rep.check(s.t, name, problems, fmt.Sprintf("%d concurrent calls ok in %.0f ms (slowest %.0f ms)", callers, ms(wall), ms(slowest)))
}

func (s *suite) shutdown() bool {
	const name = "shutdown"
	if !s.needRegistered(name) {
		return false
	}
	before := s.e.rec.snapshot()
	how, err := s.t.shutdown(s.e)
	if err != nil {
		s.rep.fail(s.t, name, "%v", err)
		return false
	}
	if v, ok := s.e.rec.waitFor(s.e.scaled(5*time.Second), func(v view) bool { return len(v.disconnects) > len(before.disconnects) }); !ok {
		s.rep.fail(s.t, name, "%s, but the kubelet code saw no disconnect (%d)", how, len(v.disconnects))
		return false
	}
	s.rep.pass(s.t, name, "%s; disconnect seen", how)
	return true
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
