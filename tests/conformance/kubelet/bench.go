package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type latencyStats struct {
	Concurrency int     `json:"concurrency"`
	Calls       int     `json:"calls"`
	Errors      int     `json:"errors"`
	P50Us       float64 `json:"p50_us"`
	P90Us       float64 `json:"p90_us"`
	P99Us       float64 `json:"p99_us"`
	MaxUs       float64 `json:"max_us"`
	MeanUs      float64 `json:"mean_us"`
	WallS       float64 `json:"wall_s"`
	CallsPerSec float64 `json:"calls_per_s"`
	FirstError  string  `json:"first_error,omitempty"`
}

type targetBench struct {
	Target       string         `json:"target"`
	Description  string         `json:"description"`
	RegisteredIn float64        `json:"registered_in_s"`
	Results      []latencyStats `json:"results"`
	Error        string         `json:"error,omitempty"`
}

type benchReport struct {
	Kubelet     string        `json:"kubelet"`
	Adapter     string        `json:"adapter"`
	Go          string        `json:"go"`
	CPUs        int           `json:"cpus"`
	Client      string        `json:"client"`
	Request     string        `json:"request"`
	Calls       int           `json:"calls_per_level"`
	Warmup      int           `json:"warmup_calls"`
	Targets     []targetBench `json:"targets"`
	Description string        `json:"description"`
}

func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	if i < 0 {
		i = 0
	}
	return float64(sorted[i].Nanoseconds()) / 1000
}

// measure runs `calls` Allocate calls spread over `concurrency` callers.
func measure(api pluginapi.DevicePluginClient, ids []string, calls, concurrency int) latencyStats {
	lat := make([]time.Duration, calls)
	var next atomic.Int64
	var errCount atomic.Int64
	var firstErr atomic.Value
	var wg sync.WaitGroup
	start := make(chan struct{})
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for {
				i := int(next.Add(1)) - 1
				if i >= calls {
					return
				}
				req := &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{ids[i%len(ids)]}}}}
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				t0 := time.Now()
				_, err := api.Allocate(ctx, req)
				lat[i] = time.Since(t0)
				cancel()
				if err != nil {
					errCount.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
				}
			}
		}()
	}
	began := time.Now()
	close(start)
	wg.Wait()
	wall := time.Since(began)
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	st := latencyStats{
		Concurrency: concurrency,
		Calls:       calls,
		Errors:      int(errCount.Load()),
		P50Us:       percentile(lat, 50),
		P90Us:       percentile(lat, 90),
		P99Us:       percentile(lat, 99),
		MaxUs:       percentile(lat, 100),
		MeanUs:      float64(sum.Nanoseconds()) / 1000 / float64(calls),
		WallS:       wall.Seconds(),
		CallsPerSec: float64(calls) / wall.Seconds(),
	}
	for _, f := range []*float64{&st.P50Us, &st.P90Us, &st.P99Us, &st.MaxUs, &st.MeanUs, &st.CallsPerSec} {
		*f = math.Round(*f*10) / 10
	}
	st.WallS = math.Round(st.WallS*1000) / 1000
	if e, ok := firstErr.Load().(string); ok {
		st.FirstError = e
	}
	return st
}

func benchTarget(cfg *config, t target, description string) (tb targetBench) {
	tb = targetBench{Target: t.name(), Description: description}
	e, err := newEnv(cfg, "bench-"+t.name())
	if err != nil {
		tb.Error = err.Error()
		return tb
	}
	defer e.close()
	defer t.cleanup()
	if err := e.startKubelet(); err != nil {
		tb.Error = err.Error()
		return tb
	}
	began := time.Now()
	if err := t.start(e); err != nil {
		tb.Error = err.Error()
		return tb
	}
	v, snap, ok := e.registered(1, registrationTimeout)
	if !ok {
		tb.Error = "no registration within " + e.scaled(registrationTimeout).String()
		if d := t.diagnostics(); d != "" {
			tb.Error += "\n" + d
		}
		return tb
	}
	tb.RegisteredIn = math.Round(snap.at.Sub(began).Seconds()*1000) / 1000
	api := v.current.API()
	ids := e.uuids(0, 1, 2, 3, 4, 5, 6, 7)
	measure(api, ids, cfg.warmup, 1)
	for _, c := range cfg.concurrency {
		tb.Results = append(tb.Results, measure(api, ids, cfg.calls, c))
	}
	if _, err := t.shutdown(e); err != nil && !errors.Is(err, errNotApplicable) {
		tb.Error = "shutdown: " + err.Error()
	}
	return tb
}

func runBench(cfg *config) benchReport {
	rep := benchReport{
		Kubelet:     kubeletVersion(),
		Adapter:     adapterName,
		Go:          runtime.Version(),
		CPUs:        runtime.NumCPU(),
		Client:      "the kubelet's plugin client (DevicePlugin.API() handed to PluginConnected), unix socket",
		Request:     "Allocate, one container, one GPU (cycling over 8)",
		Calls:       cfg.calls,
		Warmup:      cfg.warmup,
		Description: "Allocate latency through the kubelet's own gRPC client, Python plugin and the kubelet's Go Stub in the same process run",
	}
	for _, name := range cfg.targets {
		switch name {
		case "plugin":
			rep.Targets = append(rep.Targets, benchTarget(cfg, &pythonPlugin{cfg: cfg}, "Python plugin, simulated backend"))
		case "stub":
			rep.Targets = append(rep.Targets, benchTarget(cfg, &goStub{cfg: cfg},
				"the kubelet's Go Stub (pkg/kubelet/cm/devicemanager/plugin/v1beta1) with the harness's reference Allocate"))
		default:
			rep.Targets = append(rep.Targets, targetBench{Target: name, Error: fmt.Sprintf("unknown target %q", name)})
		}
	}
	return rep
}
