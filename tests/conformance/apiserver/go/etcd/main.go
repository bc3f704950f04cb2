// Command etcd is a plain etcd server: etcd's own entry point, nothing added.
// It exists so the conformance tests can build the server from etcd's Go module
// at a pinned version instead of relying on a distribution package.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
