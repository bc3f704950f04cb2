// Command kubelet-peer runs the kubelet's own device-plugin registration server and plugin
// client (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1, pinned by go.mod or
// an alternate -modfile) against the Python device plugin, and against the kubelet's Stub as a
// control.
//
// Conformance mode prints one line per result and a final "N passed, N failed" line:
//
//	PASS <target>/<scenario> - <detail>
//	FAIL <target>/<scenario>: <reason>
//	N/A <target>/<scenario>: <why it does not apply>
//
// Lines starting with "#" are comments. Bench mode prints one JSON document.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"
)

type config struct {
	mode            string
	targets         []string
	resource        string
	python          string
	pluginCwd       string
	pluginModule    string
	pluginLogLevel  string
	pluginExtraArgs []string
	pollInterval    string
	timeoutScale    float64
	keep            bool
	calls           int
	warmup          int
	concurrency     []int
}

func kubeletVersion() string {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	for _, dep := range info.Deps {
		if dep.Path == "k8s.io/kubernetes" {
			return "k8s.io/kubernetes " + dep.Version
		}
	}
	return "unknown"
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func main() {
	cfg := &config{}
	var targets, concurrency, extra string
	var verbosity int
	var showVersion bool
	flag.StringVar(&cfg.mode, "mode", "conformance", "conformance or bench")
	flag.StringVar(&targets, "targets", "plugin,stub", "comma-separated: plugin (the Python plugin), stub (the kubelet's Stub)")
	flag.StringVar(&cfg.resource, "resource", "nvidia.com/gpu", "resource name the plugin registers")
	flag.StringVar(&cfg.python, "python", "python3", "Python interpreter that runs the plugin")
	flag.StringVar(&cfg.pluginCwd, "plugin-cwd", ".", "working directory for the plugin (the repository root)")
	flag.StringVar(&cfg.pluginModule, "plugin-module", "plugin", "module run with `python -m`")
	flag.StringVar(&cfg.pluginLogLevel, "plugin-log-level", "info", "plugin --log-level")
	flag.StringVar(&extra, "plugin-extra-args", "", "extra arguments for the plugin, space-separated")
	flag.StringVar(&cfg.pollInterval, "poll-interval", "0.1", "plugin --poll-interval in seconds")
	flag.Float64Var(&cfg.timeoutScale, "timeout-scale", 1, "multiply every wait by this (slow machines)")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the temporary directories (plugin logs, node files)")
	flag.IntVar(&cfg.calls, "calls", 2000, "bench: Allocate calls per concurrency level")
	flag.IntVar(&cfg.warmup, "warmup", 200, "bench: warm-up calls before measuring")
	flag.StringVar(&concurrency, "concurrency", "1,16,64", "bench: concurrent callers, comma-separated levels")
	flag.IntVar(&verbosity, "v", -1, "kubelet code log verbosity on stderr; -1 discards its logs")
	flag.BoolVar(&showVersion, "version", false, "print the pinned kubelet version and exit")
	flag.Parse()
	cfg.targets = splitList(targets)
	cfg.pluginExtraArgs = strings.Fields(extra)
	for _, c := range splitList(concurrency) {
		n, err := strconv.Atoi(c)
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "bad -concurrency level %q\n", c)
			os.Exit(2)
		}
		cfg.concurrency = append(cfg.concurrency, n)
	}

	if showVersion {
		fmt.Printf("%s (%s) %s\n", kubeletVersion(), adapterName, runtime.Version())
		return
	}

	if verbosity < 0 {
		klog.SetLogger(logr.Discard())
	} else {
		fs := flag.NewFlagSet("klog", flag.ContinueOnError)
		klog.InitFlags(fs)
		_ = fs.Set("v", strconv.Itoa(verbosity))
		_ = fs.Set("logtostderr", "true")
		klog.SetOutput(os.Stderr)
	}
	// grpc-go logs to stderr through its own logger; keep it quiet unless asked.
	if verbosity < 0 {
		os.Setenv("GRPC_GO_LOG_SEVERITY_LEVEL", "ERROR")
	}

	switch cfg.mode {
	case "conformance":
		os.Exit(runConformance(cfg))
	case "bench":
		rep := runBench(cfg)
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(rep)
		for _, t := range rep.Targets {
			if t.Error != "" {
				os.Exit(1)
			}
		}
	default:
		fmt.Fprintf(os.Stderr, "unknown -mode %q\n", cfg.mode)
		os.Exit(2)
	}
}

func runConformance(cfg *config) int {
	fmt.Printf("# kubelet-peer: %s, adapter %s, %s\n", kubeletVersion(), adapterName, runtime.Version())
	rep := &reporter{}
	var live []target
	var envs []*env
	// Never leave a plugin process behind, even when interrupted.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		s := <-sig
		for _, t := range live {
			t.cleanup()
		}
		for _, e := range envs {
			e.close()
		}
		fmt.Fprintf(os.Stderr, "interrupted by %v\n", s)
		os.Exit(130)
	}()

	for _, name := range cfg.targets {
		var t target
		switch name {
		case "plugin":
			t = &pythonPlugin{cfg: cfg}
		case "stub":
			t = &goStub{cfg: cfg}
		default:
			fmt.Printf("FAIL %s/setup: unknown target\n", name)
			rep.failed++
			continue
		}
		fmt.Printf("# target %s\n", name)
		e, err := newEnv(cfg, name)
		if err != nil {
			rep.fail(t, "setup", "%v", err)
			continue
		}
		envs = append(envs, e)
		live = append(live, t)
		if err := e.startKubelet(); err != nil {
			rep.fail(t, "setup", "kubelet registration server: %v", err)
		} else {
			(&suite{e: e, t: t, rep: rep}).run()
		}
		t.cleanup()
		e.close()
		runSharingScenarios(cfg, rep, t, func(t target, e *env) {
			live = append(live, t)
			envs = append(envs, e)
		})
	}
	if rep.skip > 0 {
		fmt.Printf("# %d not applicable\n", rep.skip)
	}
	fmt.Printf("%d passed, %d failed\n", rep.passed, rep.failed)
	if rep.failed > 0 {
		return 1
	}
	return 0
}
