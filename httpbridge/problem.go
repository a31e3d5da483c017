package httpbridge

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// Problem types: the stable "type" URIs of the application/problem+json
// (RFC 9457) answers the bridge gives itself. Handlers' own responses are
// passed through and replayed as they are.
const (
	problemBase = "https://justonce.dev/problems/"

	// ProblemMissingKey (400): the route requires a key and none was sent.
	ProblemMissingKey = problemBase + "missing-key"
	// ProblemInvalidKey (400): the key header is malformed: a list, repeated,
	// empty, too long, non-printable, or not of the route's KeyFormat.
	ProblemInvalidKey = problemBase + "invalid-key"
	// ProblemBodyUnreadable (400): the request body could not be read.
	ProblemBodyUnreadable = problemBase + "body-unreadable"
	// ProblemInProgress (409): a request with this key is running now;
	// retry after Retry-After with the same key.
	ProblemInProgress = problemBase + "request-in-progress"
	// ProblemBodyTooLarge (413): the body is over the route's MaxBodyBytes.
	ProblemBodyTooLarge = problemBase + "body-too-large"
	// ProblemKeyReused (422): the key was used with another request
	// (method, path, body or fingerprinted headers differ). Its
	// "differences" member, when present, names what differs (never the
	// values): "method", "path", "content-type", "query:<name>",
	// "header:<Name>", "form:<field>", "body:<JSON pointer>", or "body"
	// for a body compared whole. It is absent when the key was recorded
	// without that detail (by a release before it, or with
	// Config.LegacyFingerprints).
	ProblemKeyReused = problemBase + "key-reused"
	// ProblemKeyFailed (422): the key's operation failed for good (a
	// consumer dead-lettered it, or a lease-mode response could not be
	// kept); it will not run again under this key. Use a new key.
	ProblemKeyFailed = problemBase + "key-failed"
	// ProblemResponseExpired (422): the key's operation ran and succeeded
	// (or answered as it did), but its stored response has passed the
	// route's ResultTTL and is no longer kept, while the key still is. It
	// does not run again under this key; fetch the resource's current
	// state instead. Its "completed_at" member says when it ran.
	ProblemResponseExpired = problemBase + "response-expired"
	// ProblemQuotaExceeded (429): the tenant holds too many live keys in
	// this scope.
	ProblemQuotaExceeded = problemBase + "quota-exceeded"
	// ProblemKeyRateExceeded (429): the tenant started its limit of new
	// keys in the current window (RouteConfig.KeyRate); Retry-After says
	// when the window ends. Nothing was recorded: the same key may be
	// sent again then.
	ProblemKeyRateExceeded = problemBase + "key-rate-exceeded"
	// ProblemResponseTooLarge (500): the handler's response is over the
	// route's MaxResponseBytes, so it could not be stored.
	ProblemResponseTooLarge = problemBase + "response-too-large"
	// ProblemNotCommitted (500): the handler answered success, but its
	// transaction did not commit: a statement in it had failed and the
	// handler went on anyway (the transaction was aborted, so COMMIT rolled
	// back), or the database refused the commit (a deferred constraint).
	// Nothing was done or stored and the key is free: a retry with the same
	// key runs the operation again. It is the handler's failure, like a 5xx
	// it answers itself.
	ProblemNotCommitted = problemBase + "not-committed"
	// ProblemReplayUnavailable (500): the stored response cannot be
	// decrypted (its key ID is no longer configured).
	ProblemReplayUnavailable = problemBase + "replay-unavailable"
	// ProblemLeaseLost (500): a lease-mode handler outlived its lease and
	// another attempt may have taken the key over.
	ProblemLeaseLost = problemBase + "lease-lost"
	// ProblemOverloaded (503): the ledger's database is busy: no
	// connection of its pool came free within Config.AcquireWait, so the
	// request was shed before it ran. Nothing was done or recorded; send it
	// again with the same key after Retry-After.
	ProblemOverloaded = problemBase + "overloaded"
	// ProblemStoreUnavailable (503): the ledger's database is unreachable;
	// nothing was recorded. Retry with the same key.
	ProblemStoreUnavailable = problemBase + "store-unavailable"
)

// problem is an RFC 9457 problem details object.
type problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Differences is key-reused's extension member.
	Differences []string `json:"differences,omitempty"`
	// CompletedAt is response-expired's extension member (RFC 3339).
	CompletedAt string `json:"completed_at,omitempty"`
}

var problemTitles = map[string]string{
	ProblemMissingKey:        "Idempotency-Key required",
	ProblemInvalidKey:        "Invalid Idempotency-Key",
	ProblemBodyUnreadable:    "Request body unreadable",
	ProblemInProgress:        "Request in progress",
	ProblemBodyTooLarge:      "Request body too large",
	ProblemKeyReused:         "Idempotency-Key reused",
	ProblemKeyFailed:         "Operation failed",
	ProblemResponseExpired:   "Stored response expired",
	ProblemQuotaExceeded:     "Too many live Idempotency-Keys",
	ProblemKeyRateExceeded:   "Too many new Idempotency-Keys",
	ProblemResponseTooLarge:  "Response too large to store",
	ProblemNotCommitted:      "Operation not committed",
	ProblemReplayUnavailable: "Stored response unavailable",
	ProblemLeaseLost:         "Lease lost",
	ProblemStoreUnavailable:  "Idempotency store unavailable",
	ProblemOverloaded:        "Server overloaded",
	"about:blank":            "Internal Server Error",
}

// writeProblem answers with a problem; extra headers (Retry-After, the
// replay header) are set first.
func writeProblem(w http.ResponseWriter, typ string, status int, detail string, extra ...string) {
	writeProblemOf(w, problem{Type: typ, Status: status, Detail: detail}, extra...)
}

// writeProblemOf answers with p, titled after its type.
func writeProblemOf(w http.ResponseWriter, p problem, extra ...string) {
	p.Title = problemTitles[p.Type]
	body, _ := json.Marshal(p)
	status := p.Status
	h := w.Header()
	for i := 0; i+1 < len(extra); i += 2 {
		h.Set(extra[i], extra[i+1])
	}
	h.Set("Content-Type", "application/problem+json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}
