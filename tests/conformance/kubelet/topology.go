package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// gpu is one entry of the simulated node file read by the plugin's simulated backend.
type gpu struct {
	UUID        string         `json:"uuid"`
	Index       int            `json:"index"`
	NUMANode    int64          `json:"numa_node"`
	Name        string         `json:"name"`
	MemoryMiB   int            `json:"memory_mib"`
	NVLinkPeers []int          `json:"nvlink_peers"`
	PCIeSwitch  string         `json:"pcie_switch"`
	Signals     map[string]any `json:"signals"`
	MigDevices  []migDevice    `json:"mig_devices,omitempty"`
}

// migDevice is one MIG slice of a GPU in the simulated node file.
type migDevice struct {
	UUID              string `json:"uuid"`
	GPUInstanceID     int    `json:"gpu_instance_id"`
	ComputeInstanceID int    `json:"compute_instance_id"`
	Profile           string `json:"profile"`
	MemoryMiB         int    `json:"memory_mib"`
}

type nodeFile struct {
	GPUs []gpu `json:"gpus"`
}

// defaultGPUs is an 8-GPU node: NUMA 0 for indices 0-3 and 1 for 4-7, NVLink islands
// {0,1,2,3} and {4,5,6,7} (all-to-all inside an island), PCIe switches shared by pairs.
func defaultGPUs() []gpu {
	gpus := make([]gpu, 8)
	for i := range gpus {
		island := i / 4
		var peers []int
		for j := island * 4; j < island*4+4; j++ {
			if j != i {
				peers = append(peers, j)
			}
		}
		gpus[i] = gpu{
			UUID:        fmt.Sprintf("GPU-6b0c9a1e-3f2d-4c5b-8a79-%012x", 0xc0ffee000+i),
			Index:       i,
			NUMANode:    int64(island),
			Name:        "NVIDIA H100 80GB HBM3",
			MemoryMiB:   81559,
			NVLinkPeers: peers,
			PCIeSwitch:  fmt.Sprintf("sw%d", i/2),
			Signals:     map[string]any{},
		}
	}
	return gpus
}

func nvlinkIsland(index int) int { return index / 4 }

// writeNodeFile replaces the node file atomically (temp file + rename), as the plugin expects.
func writeNodeFile(path string, gpus []gpu) error {
	data, err := json.MarshalIndent(nodeFile{GPUs: gpus}, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".node-*.json")
	if err != nil {
		return err
	}
	if _, err := tmp.Write(append(data, '\n')); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// devNodes are the character-device stand-ins the plugin's Allocate refers to.
func devNodes(gpus []gpu) []string {
	names := []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"}
	for _, g := range gpus {
		names = append(names, fmt.Sprintf("nvidia%d", g.Index))
	}
	return names
}

func makeDevRoot(devRoot string, gpus []gpu) error {
	dir := filepath.Join(devRoot, "dev")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, name := range devNodes(gpus) {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// expectedDevices is the ListAndWatch content a node file should produce.
func expectedDevices(gpus []gpu, unhealthy map[int]bool) []*pluginapi.Device {
	devs := make([]*pluginapi.Device, 0, len(gpus))
	for _, g := range gpus {
		health := pluginapi.Healthy
		if unhealthy[g.Index] {
			health = pluginapi.Unhealthy
		}
		devs = append(devs, &pluginapi.Device{
			ID:       g.UUID,
			Health:   health,
			Topology: &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: g.NUMANode}}},
		})
	}
	return devs
}
