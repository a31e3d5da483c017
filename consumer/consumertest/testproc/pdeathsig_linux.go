package testproc

import (
	"os/exec"
	"syscall"
)

// dieWithParent has the kernel SIGKILL the child when the parent dies.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
