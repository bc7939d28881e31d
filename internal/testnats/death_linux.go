package testnats

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes cmd's process die when the test process that
// started it does (a test binary killed at its timeout leaves no server).
func dieWithParent(cmd *exec.Cmd) { cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }
