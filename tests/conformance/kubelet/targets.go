package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

var errNotApplicable = errors.New("not applicable")

// target is a device plugin the scenarios drive: the Python plugin or the kubelet's Stub.
type target interface {
	name() string
	// start launches the plugin; it registers on its own (plugin) or is registered (stub).
	start(e *env) error
	// setSignals injects or clears health signals of one GPU.
	setSignals(e *env, index int, signals map[string]any) error
	// persistsHealth: latched faults survive kubelet and plugin restarts.
	persistsHealth() bool
	// afterKubeletRestart is called once the new registration server runs.
	afterKubeletRestart(e *env) error
	kill(e *env) error
	restart(e *env) error
	// shutdown stops the plugin the orderly way; the string describes how it ended.
	shutdown(e *env) (string, error)
	// diagnostics is printed to stderr when a scenario fails.
	diagnostics() string
	cleanup()
}

// ---- Python plugin -------------------------------------------------------------------------

type pythonPlugin struct {
	cfg     *config
	logPath string
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error
	starts  int
}

func (p *pythonPlugin) name() string         { return "plugin" }
func (p *pythonPlugin) persistsHealth() bool { return true }

func (p *pythonPlugin) argv(e *env) []string {
	args := []string{
		"-m", p.cfg.pluginModule, "run",
		"--backend", "simulated",
		"--simulated-node", e.nodeFile,
		"--device-plugin-dir", e.pluginDir,
		"--state-dir", e.stateDir,
		"--dev-root", e.devRoot,
		"--poll-interval", p.cfg.pollInterval,
		"--log-level", p.cfg.pluginLogLevel,
	}
	args = append(args, e.extraArgs...)
	return append(args, p.cfg.pluginExtraArgs...)
}

func (p *pythonPlugin) start(e *env) error {
	p.starts++
	if p.logPath == "" {
		p.logPath = filepath.Join(e.dir, "plugin.log")
	}
	logFile, err := os.OpenFile(p.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	args := p.argv(e)
	fmt.Fprintf(logFile, "=== start %d: %s %s\n", p.starts, p.cfg.python, strings.Join(args, " "))
	cmd := exec.Command(p.cfg.python, args...)
	cmd.Dir = p.cfg.pluginCwd
	cmd.Env = append(os.Environ(), "PYTHONUNBUFFERED=1")
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", p.cfg.python, err)
	}
	p.cmd = cmd
	p.exited = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) {
		err := cmd.Wait()
		p.waitErr = err
		close(done)
	}(cmd, p.exited)
	return nil
}

func (p *pythonPlugin) running() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.exited:
		return false
	default:
		return true
	}
}

func (p *pythonPlugin) setSignals(e *env, index int, signals map[string]any) error {
	e.gpus[index].Signals = signals
	return writeNodeFile(e.nodeFile, e.gpus)
}

func (p *pythonPlugin) afterKubeletRestart(e *env) error { return nil }

func (p *pythonPlugin) kill(e *env) error {
	if !p.running() {
		return fmt.Errorf("plugin process is not running (%v)", p.waitErr)
	}
	// The whole process group: nothing of the old instance may survive.
	if err := syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		return err
	}
	select {
	case <-p.exited:
		return nil
	case <-time.After(10 * time.Second):
		return errors.New("plugin did not die after SIGKILL")
	}
}

func (p *pythonPlugin) restart(e *env) error { return p.start(e) }

func (p *pythonPlugin) shutdown(e *env) (string, error) {
	if !p.running() {
		return "", fmt.Errorf("plugin process already exited (%v)", p.waitErr)
	}
	began := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		return "", err
	}
	select {
	case <-p.exited:
	case <-time.After(e.scaled(15 * time.Second)):
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
		return "", errors.New("no exit within 15s of SIGTERM (killed)")
	}
	code := p.cmd.ProcessState.ExitCode()
	if code != 0 {
		return "", fmt.Errorf("exit code %d after SIGTERM (%v)", code, p.cmd.ProcessState)
	}
	return fmt.Sprintf("exit 0 %.2fs after SIGTERM", time.Since(began).Seconds()), nil
}

func (p *pythonPlugin) diagnostics() string {
	if p.logPath == "" {
		return ""
	}
	data, err := os.ReadFile(p.logPath)
	if err != nil {
		return ""
	}
	const tail = 6000
	if len(data) > tail {
		data = data[len(data)-tail:]
	}
	return "--- plugin log (tail) ---\n" + string(data)
}

func (p *pythonPlugin) cleanup() {
	if p.running() {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		<-p.exited
	}
}

// ---- the kubelet's Stub (control) ----------------------------------------------------------

type goStub struct {
	cfg       *config
	stub      *stubPlugin
	instances int
	unhealthy map[int]bool
}

func (s *goStub) name() string         { return "stub" }
func (s *goStub) persistsHealth() bool { return false }

// launch creates a fresh Stub on a new socket, starts it and registers it with the kubelet.
func (s *goStub) launch(e *env) error {
	s.instances++
	socket := filepath.Join(e.pluginDir, fmt.Sprintf("stub-%d.sock", s.instances))
	stub := newStub(expectedDevices(e.gpus, s.unhealthy), socket, e.cfg.resource, false, true)
	stub.SetAllocFunc(referenceAllocate(e.gpus, e.devRoot))
	stub.SetGetPreferredAllocFunc(referencePreferred(e.gpus))
	if err := stub.Start(); err != nil {
		return fmt.Errorf("Stub.Start: %w", err)
	}
	s.stub = stub
	if err := stub.Register(e.kubeletSock, e.cfg.resource); err != nil {
		return fmt.Errorf("Stub.Register: %w", err)
	}
	return nil
}

func (s *goStub) start(e *env) error {
	s.unhealthy = map[int]bool{}
	return s.launch(e)
}

// setSignals emulates a fault through Stub.Update (the Stub has no health checks). Latched
// faults need persistence the Stub does not have.
func (s *goStub) setSignals(e *env, index int, signals map[string]any) error {
	if _, ok := signals["xid_events"]; ok {
		return errNotApplicable
	}
	if len(signals) == 0 {
		delete(s.unhealthy, index)
	} else {
		s.unhealthy[index] = true
	}
	devs := expectedDevices(e.gpus, s.unhealthy)
	done := make(chan struct{})
	go func() { s.stub.Update(devs); close(done) }()
	select {
	case <-done:
		return nil
	case <-time.After(5 * time.Second):
		return errors.New("Stub.Update blocked: no ListAndWatch stream is reading")
	}
}

// afterKubeletRestart re-registers the Stub as its Watch loop would (Stub.Watch itself is not
// used: it waits 10 s before restarting and spins once its watcher is closed by Stop).
func (s *goStub) afterKubeletRestart(e *env) error {
	if _, err := os.Stat(e.kubeletSock); err != nil {
		return err
	}
	if err := s.stub.Restart(); err != nil {
		return fmt.Errorf("Stub.Restart: %w", err)
	}
	return s.stub.Register(e.kubeletSock, e.cfg.resource)
}

func (s *goStub) kill(e *env) error {
	if s.stub == nil {
		return errors.New("stub not started")
	}
	err := s.stub.Stop()
	s.stub = nil
	return err
}

func (s *goStub) restart(e *env) error { return s.launch(e) }

func (s *goStub) shutdown(e *env) (string, error) {
	if err := s.kill(e); err != nil {
		return "", err
	}
	return "Stub.Stop", nil
}

func (s *goStub) diagnostics() string { return "" }

func (s *goStub) cleanup() {
	if s.stub != nil {
		_ = s.stub.Stop()
		s.stub = nil
	}
}
