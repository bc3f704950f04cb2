// Command pause is the pod sandbox process of the local cluster: the runtime starts it first in every pod so the
// pod's namespaces outlive its containers. It does nothing until the runtime stops it, and then exits 0 so a
// stopped sandbox does not read as a failure.
//
// It reaps no zombies: containers do not share the sandbox's PID namespace unless a pod asks for it, and the
// project's pods do not.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
