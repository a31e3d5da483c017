//go:build !linux

package testproc

import "os/exec"

// DieWithParent does nothing: only Linux kills a child when its parent
// dies; Start's cleanup kills it when the test ends.
func DieWithParent(*exec.Cmd) {}
