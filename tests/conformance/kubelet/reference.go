package main

// Reference behaviour installed into the kubelet's Stub for the control run. The Stub's own
// defaults answer Allocate and GetPreferredAllocation with empty responses; these give it the
// response shape our scenarios check, so a control PASS shows the checks and the kubelet
// client plumbing are sound, independently of the Python plugin.

import (
	"fmt"
	"path/filepath"
	"sort"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type allocFunc = func(*pluginapi.AllocateRequest, map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error)
type preferredFunc = func(*pluginapi.PreferredAllocationRequest, map[string]*pluginapi.Device) (*pluginapi.PreferredAllocationResponse, error)

func referenceAllocate(gpus []gpu, devRoot string) allocFunc {
	byUUID := map[string]gpu{}
	for _, g := range gpus {
		byUUID[g.UUID] = g
	}
	spec := func(name string) *pluginapi.DeviceSpec {
		return &pluginapi.DeviceSpec{
			ContainerPath: "/dev/" + name,
			HostPath:      filepath.Join(devRoot, "dev", name),
			Permissions:   "rw",
		}
	}
	return func(r *pluginapi.AllocateRequest, _ map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error) {
		resp := &pluginapi.AllocateResponse{}
		for _, cr := range r.ContainerRequests {
			seen := map[string]bool{}
			var specs []*pluginapi.DeviceSpec
			for _, id := range cr.DevicesIds {
				g, ok := byUUID[id]
				if !ok {
					return nil, status.Errorf(codes.InvalidArgument, "unknown device ID %q", id)
				}
				if seen[id] {
					return nil, status.Errorf(codes.InvalidArgument, "duplicate device ID %q", id)
				}
				seen[id] = true
				specs = append(specs, spec(fmt.Sprintf("nvidia%d", g.Index)))
			}
			specs = append(specs, spec("nvidiactl"), spec("nvidia-uvm"), spec("nvidia-uvm-tools"))
			resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
				Envs:    map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(cr.DevicesIds, ",")},
				Devices: specs,
			})
		}
		return resp, nil
	}
}

// referencePreferred: must-include first, then grow the set with the available device that has
// the most NVLink peers in it, then the same NUMA node, then the same PCIe switch, then index.
func referencePreferred(gpus []gpu) preferredFunc {
	byUUID := map[string]gpu{}
	for _, g := range gpus {
		byUUID[g.UUID] = g
	}
	return func(r *pluginapi.PreferredAllocationRequest, _ map[string]*pluginapi.Device) (*pluginapi.PreferredAllocationResponse, error) {
		resp := &pluginapi.PreferredAllocationResponse{}
		for _, cr := range r.ContainerRequests {
			chosen := append([]string(nil), cr.MustIncludeDeviceIDs...)
			in := map[string]bool{}
			for _, id := range chosen {
				in[id] = true
			}
			// Seed an empty choice on the island with the most available devices.
			if len(chosen) == 0 && len(cr.AvailableDeviceIDs) > 0 {
				count := map[int]int{}
				for _, id := range cr.AvailableDeviceIDs {
					count[nvlinkIsland(byUUID[id].Index)]++
				}
				best := ""
				for _, id := range cr.AvailableDeviceIDs {
					if best == "" || count[nvlinkIsland(byUUID[id].Index)] > count[nvlinkIsland(byUUID[best].Index)] ||
						(count[nvlinkIsland(byUUID[id].Index)] == count[nvlinkIsland(byUUID[best].Index)] && byUUID[id].Index < byUUID[best].Index) {
						best = id
					}
				}
				chosen, in[best] = append(chosen, best), true
			}
			for len(chosen) < int(cr.AllocationSize) {
				var candidates []string
				for _, id := range cr.AvailableDeviceIDs {
					if !in[id] {
						candidates = append(candidates, id)
					}
				}
				if len(candidates) == 0 {
					break
				}
				score := func(id string) [3]int {
					g := byUUID[id]
					var s [3]int
					for _, c := range chosen {
						o := byUUID[c]
						if nvlinkIsland(o.Index) == nvlinkIsland(g.Index) {
							s[0]++
						}
						if o.NUMANode == g.NUMANode {
							s[1]++
						}
						if o.PCIeSwitch == g.PCIeSwitch {
							s[2]++
						}
					}
					return s
				}
				sort.SliceStable(candidates, func(i, j int) bool {
					a, b := score(candidates[i]), score(candidates[j])
					if a != b {
						return a[0] > b[0] || (a[0] == b[0] && (a[1] > b[1] || (a[1] == b[1] && a[2] > b[2])))
					}
					return byUUID[candidates[i]].Index < byUUID[candidates[j]].Index
				})
				chosen, in[candidates[0]] = append(chosen, candidates[0]), true
			}
			resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: chosen})
		}
		return resp, nil
	}
}
