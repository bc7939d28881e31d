//go:build !linux

package testnats

import "os/exec"

// dieWithParent does nothing where the kernel cannot tie a process's life
// to its parent's.
func dieWithParent(*exec.Cmd) {}
