package testsvc

import (
	"strings"
	"sync"
)

// LogBuffer collects what a logger writes, safe for the logger's
// goroutines and the test to share: slog.NewTextHandler(buf, nil).
type LogBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

// Write appends p.
func (s *LogBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *LogBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
