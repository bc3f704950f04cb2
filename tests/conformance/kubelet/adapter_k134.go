//go:build kube134

// Adapter for the devicemanager plugin package before contextual logging (Kubernetes 1.34
// and earlier): no logger or context arguments, clients keyed by resource name only.

package main

import (
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	dm "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

const adapterName = "k134: no contextual logging, clients keyed by resource"

type clientHandler struct{ rec sink }

func (h clientHandler) PluginConnected(resource string, p dm.DevicePlugin) error {
	return h.rec.connected(baseContext(), resource, p)
}

func (h clientHandler) PluginDisconnected(resource string) {
	h.rec.disconnected(resource, "")
}

func (h clientHandler) PluginListAndWatchReceiver(resource string, resp *pluginapi.ListAndWatchResponse) {
	h.rec.listAndWatch(resource, resp)
}

type registrationHandler struct{}

func (registrationHandler) CleanupPluginDirectory(dir string) error {
	return cleanupPluginDirectory(dir)
}

// Compile-time checks against the pinned package.
var (
	_ dm.ClientHandler       = clientHandler{}
	_ dm.RegistrationHandler = registrationHandler{}
)

type kubeletServer struct{ s dm.Server }

func newKubeletServer(socket string, rec sink) (*kubeletServer, error) {
	s, err := dm.NewServer(socket, registrationHandler{}, clientHandler{rec})
	if err != nil {
		return nil, err
	}
	return &kubeletServer{s: s}, nil
}

func (k *kubeletServer) Start() error { return k.s.Start() }
func (k *kubeletServer) Stop() error  { return k.s.Stop() }

type stubPlugin struct{ s *dm.Stub }

func newStub(devs []*pluginapi.Device, socket, resource string, preStart, preferred bool) *stubPlugin {
	return &stubPlugin{s: dm.NewDevicePluginStub(devs, socket, resource, preStart, preferred)}
}

func (p *stubPlugin) Start() error   { return p.s.Start() }
func (p *stubPlugin) Stop() error    { return p.s.Stop() }
func (p *stubPlugin) Restart() error { return p.s.Restart() }
func (p *stubPlugin) Register(kubeletSocket, resource string) error {
	return p.s.Register(kubeletSocket, resource, "")
}
func (p *stubPlugin) Update(devs []*pluginapi.Device) { p.s.Update(devs) }
func (p *stubPlugin) SetAllocFunc(f allocFunc)        { p.s.SetAllocFunc(f) }
func (p *stubPlugin) SetGetPreferredAllocFunc(f preferredFunc) {
	p.s.SetGetPreferredAllocFunc(f)
}
