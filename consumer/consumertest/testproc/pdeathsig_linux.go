package testproc

import (
	"os/exec"
	"syscall"
)

// DieWithParent has the kernel SIGKILL cmd's process, once started, when
// this process dies (Start does it for its children; a test that starts a
// process of its own with os/exec may call it before cmd.Start).
func DieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
