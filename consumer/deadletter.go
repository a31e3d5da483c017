package consumer

import (
	"strconv"
	"time"
)

// Header names a dead-lettered message carries, on every transport.
const (
	HeaderDLError     = "Justonce-Error"     // the last error
	HeaderDLAttempts  = "Justonce-Attempts"  // attempts made
	HeaderDLOrigin    = "Justonce-Origin"    // topic or subject it came from
	HeaderDLPartition = "Justonce-Partition" // Kafka partition
	HeaderDLOffset    = "Justonce-Offset"    // Kafka offset or stream sequence
	HeaderDLID        = "Justonce-Event-Id"  // the event ID, when known
	HeaderDLScope     = "Justonce-Scope"     // the ledger scope
	HeaderDLTime      = "Justonce-Failed-At" // RFC 3339 time of dead-lettering
)

// DeadLetterHeaders returns m's headers followed by the dead-letter headers
// describing why and where from.
func DeadLetterHeaders(scope string, m *Message, cause error) []Header {
	hs := make([]Header, 0, len(m.Headers)+8)
	hs = append(hs, m.Headers...)
	msg := "unknown"
	if cause != nil {
		msg = cause.Error()
	}
	hs = append(hs,
		Header{HeaderDLError, []byte(msg)},
		Header{HeaderDLAttempts, []byte(strconv.Itoa(m.Attempt))},
		Header{HeaderDLOrigin, []byte(m.Topic)},
		Header{HeaderDLPartition, []byte(strconv.Itoa(m.Partition))},
		Header{HeaderDLOffset, []byte(strconv.FormatInt(m.Offset, 10))},
		Header{HeaderDLScope, []byte(scope)},
		Header{HeaderDLTime, []byte(time.Now().UTC().Format(time.RFC3339Nano))},
	)
	if m.ID != "" {
		hs = append(hs, Header{HeaderDLID, []byte(m.ID)})
	}
	return hs
}
