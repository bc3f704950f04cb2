// The local cluster's pod sandbox process (scripts/localcluster/images.py puts it into localhost/pause:3.10).
module gpu-health-device-plugin/scripts/localcluster/pause

go 1.22
