// Package svcenv reads the addresses of the local services: from the
// environment, else from the .services.env file that `make services-up`
// writes at the repository root. It has no dependencies, so examples and
// tools can use it.
package svcenv

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"sync"
)

var (
	envOnce sync.Once
	envFile map[string]string
)

// Get returns the variable from the environment, else from the
// .services.env file at the repository root.
func Get(name string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	envOnce.Do(func() { envFile = readEnvFile() })
	return envFile[name]
}

// RepoRoot returns the directory holding go.mod, searching up from the
// working directory.
func RepoRoot() string {
	dir, err := os.Getwd()
	if err != nil {
		return ""
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return ""
		}
		dir = parent
	}
}

func readEnvFile() map[string]string {
	out := map[string]string{}
	root := RepoRoot()
	if root == "" {
		return out
	}
	f, err := os.Open(filepath.Join(root, ".services.env"))
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if ok {
			out[strings.TrimSpace(k)] = strings.Trim(strings.TrimSpace(v), `"'`)
		}
	}
	return out
}
