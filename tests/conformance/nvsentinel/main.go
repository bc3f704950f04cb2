// nvsentinel-peer stands in for NVSentinel on a node in the conformance tests: its platform connector (health events
// in) and its device API (GPUs and their conditions, shared between providers), each on its own unix socket. Both are
// served from code generated from this project's api/nvsentinel protos, which tests/conformance/test_nvsentinel_wire.py
// holds to NVSentinel's recorded descriptors. What it reproduces of NVSentinel, and what not: docs/conformance.md.
package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	deviceapi "gpu-health-device-plugin/tests/conformance/nvsentinel/gen/deviceapi/v1alpha1"
	pc "gpu-health-device-plugin/tests/conformance/nvsentinel/gen/platformconnector"
)

type options struct {
	connectorSocket string
	eventsFile      string
	failFirst       int
	failCode        codes.Code
	strict          bool
	deviceSocket    string
	deviceLog       string
}

func parseCode(name string) (codes.Code, error) {
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if strings.EqualFold(strings.ReplaceAll(c.String(), "_", ""), strings.ReplaceAll(name, "_", "")) {
			return c, nil
		}
	}
	return codes.Unknown, fmt.Errorf("--fail-code: unknown gRPC code %q", name)
}

func parseOptions(args []string) (options, error) {
	var o options
	var failCode string
	fs := flag.NewFlagSet("nvsentinel-peer", flag.ContinueOnError)
	fs.StringVar(&o.connectorSocket, "platform-connector", "", "unix socket to serve the platform connector on")
	fs.StringVar(&o.eventsFile, "events", "", "file to append every accepted HealthEvents batch to, one JSON line each")
	fs.IntVar(&o.failFirst, "fail-first", 0, "refuse the first N platform-connector calls")
	fs.StringVar(&failCode, "fail-code", "UNAVAILABLE", "gRPC code of the refused calls")
	fs.BoolVar(&o.strict, "strict", true, "also refuse events without nodeName, checkName or agent (NVSentinel accepts them)")
	fs.StringVar(&o.deviceSocket, "device-api", "", "unix socket to serve the device API (GpuService) on")
	fs.StringVar(&o.deviceLog, "device-log", "", "file to append every device-API write to, one JSON line each")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	code, err := parseCode(failCode)
	if err != nil {
		return o, err
	}
	o.failCode = code
	if o.connectorSocket == "" && o.deviceSocket == "" {
		return o, errors.New("nothing to serve: give --platform-connector and/or --device-api")
	}
	if o.connectorSocket != "" && o.eventsFile == "" {
		return o, errors.New("--platform-connector needs --events")
	}
	if o.deviceSocket != "" && o.deviceLog == "" {
		return o, errors.New("--device-api needs --device-log")
	}
	return o, nil
}

// listen binds a unix socket, replacing one a killed predecessor left behind so the peer restarts on the same path.
func listen(path string) (net.Listener, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	return net.Listen("unix", path)
}

// jsonLines appends one line per record and flushes it at once, so a test polling the file never sees half a line.
type jsonLines struct {
	mu sync.Mutex
	f  *os.File
}

func openLines(path string) (*jsonLines, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	return &jsonLines{f: f}, nil
}

func (l *jsonLines) write(line []byte) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, err := l.f.Write(append(line, '\n')); err != nil {
		return err
	}
	return l.f.Sync()
}

func main() {
	o, err := parseOptions(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "nvsentinel-peer:", err)
		os.Exit(2)
	}
	if err := run(o); err != nil {
		fmt.Fprintln(os.Stderr, "nvsentinel-peer:", err)
		os.Exit(1)
	}
}

func run(o options) error {
	type served struct {
		server *grpc.Server
		path   string
	}
	var all []served
	var devices *deviceServer
	cleanup := func() {
		if devices != nil {
			devices.closeWatches() // a watch stream would hold GracefulStop open forever
		}
		for _, s := range all {
			stopped := make(chan struct{})
			go func() { s.server.GracefulStop(); close(stopped) }()
			select {
			case <-stopped:
			case <-time.After(5 * time.Second):
				s.server.Stop()
			}
			_ = os.Remove(s.path)
		}
	}
	defer cleanup()

	start := func(path string, register func(*grpc.Server)) error {
		lis, err := listen(path)
		if err != nil {
			return fmt.Errorf("listen on %s: %w", path, err)
		}
		s := grpc.NewServer()
		register(s)
		all = append(all, served{s, path})
		go func() { _ = s.Serve(lis) }()
		return nil
	}

	if o.connectorSocket != "" {
		events, err := openLines(o.eventsFile)
		if err != nil {
			return err
		}
		conn := &connectorServer{events: events, failFirst: o.failFirst, failCode: o.failCode, strict: o.strict}
		if err := start(o.connectorSocket, func(s *grpc.Server) { pc.RegisterPlatformConnectorServer(s, conn) }); err != nil {
			return err
		}
	}
	if o.deviceSocket != "" {
		log, err := openLines(o.deviceLog)
		if err != nil {
			return err
		}
		devices = newDeviceServer(log)
		if err := start(o.deviceSocket, func(s *grpc.Server) { deviceapi.RegisterGpuServiceServer(s, devices) }); err != nil {
			return err
		}
	}
	fmt.Println("ready")

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
	return nil
}
