//go:build !kube134

// Adapter for the devicemanager plugin package with contextual logging and clients keyed by
// socket path (Kubernetes 1.37). Releases 1.35 and 1.36 have contextual logging but a
// two-argument PluginDisconnected; they would need their own adapter.

package main

import (
	"context"

	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	dm "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

const adapterName = "k137: contextual logging, clients keyed by resource and socket"

type clientHandler struct{ rec sink }

func (h clientHandler) PluginConnected(ctx context.Context, resource string, p dm.DevicePlugin) error {
	return h.rec.connected(ctx, resource, p)
}

func (h clientHandler) PluginDisconnected(_ klog.Logger, resource string, socket string) {
	h.rec.disconnected(resource, socket)
}

func (h clientHandler) PluginListAndWatchReceiver(_ klog.Logger, resource string, resp *pluginapi.ListAndWatchResponse) {
	h.rec.listAndWatch(resource, resp)
}

type registrationHandler struct{}

func (registrationHandler) CleanupPluginDirectory(_ klog.Logger, dir string) error {
	return cleanupPluginDirectory(dir)
}

// Compile-time checks against the pinned package.
var (
	_ dm.ClientHandler       = clientHandler{}
	_ dm.RegistrationHandler = registrationHandler{}
)

type kubeletServer struct{ s dm.Server }

func newKubeletServer(socket string, rec sink) (*kubeletServer, error) {
	s, err := dm.NewServer(klog.Background(), socket, registrationHandler{}, clientHandler{rec})
	if err != nil {
		return nil, err
	}
	return &kubeletServer{s: s}, nil
}

func (k *kubeletServer) Start() error { return k.s.Start(klog.Background()) }
func (k *kubeletServer) Stop() error  { return k.s.Stop(klog.Background()) }

type stubPlugin struct{ s *dm.Stub }

func newStub(devs []*pluginapi.Device, socket, resource string, preStart, preferred bool) *stubPlugin {
	return &stubPlugin{s: dm.NewDevicePluginStub(klog.Background(), devs, socket, resource, preStart, preferred)}
}

func (p *stubPlugin) Start() error   { return p.s.Start(context.Background()) }
func (p *stubPlugin) Stop() error    { return p.s.Stop(klog.Background()) }
func (p *stubPlugin) Restart() error { return p.s.Restart(context.Background()) }
func (p *stubPlugin) Register(kubeletSocket, resource string) error {
	return p.s.Register(context.Background(), kubeletSocket, resource, "")
}
func (p *stubPlugin) Update(devs []*pluginapi.Device) { p.s.Update(devs) }
func (p *stubPlugin) SetAllocFunc(f allocFunc)        { p.s.SetAllocFunc(f) }
func (p *stubPlugin) SetGetPreferredAllocFunc(f preferredFunc) {
	p.s.SetGetPreferredAllocFunc(f)
}
