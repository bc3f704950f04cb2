package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func baseContext() context.Context { return context.Background() }

// cleanupPluginDirectory does what the kubelet's ManagerImpl.CleanupPluginDirectory does when
// the registration server starts: remove every unix socket in the plugin directory (other
// files, such as the checkpoint, stay).
func cleanupPluginDirectory(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, entry := range entries {
		path := filepath.Join(dir, entry.Name())
		st, err := os.Stat(path)
		if err != nil || st.IsDir() || st.Mode()&os.ModeSocket == 0 {
			continue
		}
		if err := os.RemoveAll(path); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// env is one isolated node: a plugin directory with the kubelet's registration server, a
// simulated node file, a state directory and a fake /dev.
type env struct {
	cfg         *config
	dir         string
	pluginDir   string
	kubeletSock string
	nodeFile    string
	stateDir    string
	devRoot     string
	gpus        []gpu
	rec         *recorder
	kubelet     *kubeletServer
	// handler, when set, receives the kubelet code's callbacks instead of rec (several resources).
	handler sink
	// extraArgs are appended to the plugin's command line for this node only (e.g. --config).
	extraArgs []string
}

func newEnv(cfg *config, label string) (*env, error) {
	// Unix socket paths are limited to 107 bytes: keep the directory short.
	dir, err := os.MkdirTemp("", "kpeer-"+label+"-")
	if err != nil {
		return nil, err
	}
	e := &env{
		cfg:       cfg,
		dir:       dir,
		pluginDir: filepath.Join(dir, "dp") + string(filepath.Separator),
		nodeFile:  filepath.Join(dir, "node.json"),
		stateDir:  filepath.Join(dir, "state"),
		devRoot:   filepath.Join(dir, "root"),
		gpus:      defaultGPUs(),
		rec:       newRecorder(cfg.resource),
	}
	e.kubeletSock = filepath.Join(e.pluginDir, kubeletSocketName)
	for _, d := range []string{e.pluginDir, e.stateDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := makeDevRoot(e.devRoot, e.gpus); err != nil {
		return nil, err
	}
	if err := writeNodeFile(e.nodeFile, e.gpus); err != nil {
		return nil, err
	}
	return e, nil
}

// startKubelet creates and starts a new registration server, as a (re)starting kubelet does;
// Start wipes the sockets in the plugin directory through the registration handler.
func (e *env) startKubelet() error {
	var h sink = e.rec
	if e.handler != nil {
		h = e.handler
	}
	s, err := newKubeletServer(e.kubeletSock, h)
	if err != nil {
		return fmt.Errorf("NewServer: %w", err)
	}
	if err := s.Start(); err != nil {
		return fmt.Errorf("server Start: %w", err)
	}
	e.kubelet = s
	return nil
}

func (e *env) stopKubelet() error {
	if e.kubelet == nil {
		return nil
	}
	err := e.kubelet.Stop()
	e.kubelet = nil
	return err
}

func (e *env) close() {
	_ = e.stopKubelet()
	if !e.cfg.keep {
		os.RemoveAll(e.dir)
	} else {
		fmt.Fprintf(os.Stderr, "kept %s\n", e.dir)
	}
}

func (e *env) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * e.cfg.timeoutScale)
}

func (e *env) uuids(indices ...int) []string {
	out := make([]string, len(indices))
	for i, idx := range indices {
		out[i] = e.gpus[idx].UUID
	}
	return out
}

func (e *env) indexOf(uuid string) int {
	for _, g := range e.gpus {
		if g.UUID == uuid {
			return g.Index
		}
	}
	return -1
}

// registered waits for the n-th successful registration and the first ListAndWatch message
// after it.
func (e *env) registered(n int, timeout time.Duration) (view, snapRecord, bool) {
	v, ok := e.rec.waitFor(e.scaled(timeout), func(v view) bool {
		_, got := v.firstAfter(n)
		return v.okConnects() >= n && got && v.current != nil
	})
	snap, _ := v.firstAfter(n)
	return v, snap, ok
}

// api returns the kubelet's client for the currently connected plugin.
func (e *env) api() (pluginapi.DevicePluginClient, error) {
	v := e.rec.snapshot()
	if v.current == nil {
		return nil, errors.New("no plugin connected")
	}
	return v.current.API(), nil
}

// kubeletSocketName is the registration socket's file name (pluginapi.KubeletSocket is the
// full production path).
var kubeletSocketName = filepath.Base(pluginapi.KubeletSocket)
