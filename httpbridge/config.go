package httpbridge

import (
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// DefaultExpiresHeader is the response header that says until when the
// request's key is remembered (Config.ExpiresHeader).
const DefaultExpiresHeader = "Idempotency-Key-Expires"

// Defaults.
const (
	defaultHeader           = "Idempotency-Key"
	defaultReplayHeader     = "Idempotent-Replayed"
	defaultMaxKeyLen        = inbox.MaxPartLen
	defaultMaxBodyBytes     = 1 << 20
	defaultMaxResponseBytes = 1 << 20
	defaultRetryAfter       = time.Second
	defaultHandlerTimeout   = time.Minute
)

// DefaultAcquireWait is Config.AcquireWait's default: how long a request
// waits for a database connection before it is shed with 503.
const DefaultAcquireWait = bridgereq.DefaultAcquireWait

// Config configures a Bridge: what is shared by every route. Per-route
// settings are in RouteConfig. The zero value of every field but Ledger
// is a working default.
type Config struct {
	// Ledger records the requests, in the same processed_events table the
	// consumers use. Required.
	Ledger *inbox.Ledger

	// Header names the request header carrying the key. Default
	// "Idempotency-Key".
	Header string
	// AltHeaders are other accepted names for the key header. Nil means
	// {"X-Idempotency-Key"}; an empty non-nil slice accepts Header only.
	// A request carrying two of the names must give the same key in both.
	AltHeaders []string
	// MaxKeyLen is the longest key accepted, in bytes (1 to 255). Default
	// 255. Routes with MismatchNewRequest accept at most 238 (the ledger ID
	// also holds a fingerprint suffix), routes isolating keys per principal
	// at most 231, and 214 with both.
	MaxKeyLen int

	// Tenant returns the request's tenant, typically from the auth context
	// an earlier middleware put in r.Context(). Keys never match across
	// tenants. Nil: no tenants (""), which is also what consumers use.
	Tenant func(r *http.Request) string
	// Principal returns who sent the request (a user or API client ID),
	// typically from the auth context. It is recorded in the ledger for
	// audit and, by default, isolates keys per principal: a key replays
	// only to the principal that first sent it, and another principal's
	// request with the same key runs on its own (see
	// RouteConfig.PrincipalKeys). Nil, or "" for a request: keys are shared
	// by every caller of the tenant, as they are with consumers.
	Principal func(r *http.Request) string

	// ReplayHeader is set to "true" on replayed responses. Default
	// "Idempotent-Replayed".
	ReplayHeader string
	// LegacyReplayHeader, when set (for example "X-Idempotency-Replay"), is
	// also set to "true" on replayed responses.
	LegacyReplayHeader string
	// ExpiresHeader names the response header that tells the client until
	// when its key is remembered, as an HTTP-date (rounded down to the
	// second): past that time a request with the key runs as a new one.
	// It is on every answer that concerns a recorded key: a first run
	// whose response was stored, a replay, a request in flight (then a
	// lower bound: the key's first request is at most HandlerTimeout old),
	// a key reused with another request, a key that failed. It is never
	// stored. httpretry stops retrying a key once it has expired. Default
	// DefaultExpiresHeader ("Idempotency-Key-Expires").
	ExpiresHeader string
	// DenyHeaders are response headers never stored nor replayed, in
	// addition to the credentials always denied: Set-Cookie, Set-Cookie2,
	// Authorization, Proxy-Authorization, and hop-by-hop headers. The first
	// response still carries them.
	DenyHeaders []string

	// RetryAfter is the Retry-After sent with 409 (in flight) and 503
	// (store down, overloaded). Default 1 s; it is rounded up to whole seconds.
	RetryAfter time.Duration
	// AcquireWait bounds how long a request waits for a connection from
	// the ledger's pool, where requests queue when the database cannot
	// keep up. When it runs out (every connection in use), the request
	// is shed: its handler does not run, nothing is recorded, and the
	// client gets 503 (ProblemOverloaded) with Retry-After; its retry with
	// the same key runs once. Default DefaultAcquireWait (1 s). It is
	// checked before each ledger claim, and for a keyless request on a
	// transactional route before its transaction begins.
	AcquireWait time.Duration
	// HandlerTimeout bounds a keyed request's handler and ledger work. Keyed
	// handlers run on a context that does not end when the client goes
	// away, so that work a client started is finished and recorded, and the
	// client's retry gets the replay. Default 1 minute.
	HandlerTimeout time.Duration

	// Encryption, when set, encrypts stored response bodies (AES-GCM).
	Encryption *Encryption

	// LegacyFingerprints stores fingerprints as releases before detailed
	// fingerprints did (a digest of the whole request, 33 bytes): a 422
	// key-reused answer then names no differences. Set it while instances
	// of such a release serve the same ledger (a rolling upgrade), so
	// that they recognise this release's keys; unset it once every
	// instance runs this release. Keys stored that way are always
	// recognised. Default false: fingerprints also carry short digests of
	// the request's parts (at most 32, about 200 bytes for a small JSON
	// body, never more than 1 KiB more than before).
	LegacyFingerprints bool

	// OnObserve, when set, is told what an observe-mode route
	// (RouteConfig.Observe) would have done with each request it let
	// through: the route's scope and one of
	//
	//	would_run                 a new key: the handler would have run, as it did
	//	would_replay              a known key (completed, failed for good, or run by a
	//	                          consumer or over gRPC): answered from the ledger
	//	would_refuse_missing_key  no key on a route with Required: 400
	//	would_refuse_invalid_key  a key the route refuses: 400
	//	would_conflict            a key in flight: 409
	//	would_mismatch            a known key with another request: 422
	//
	// Requests without a key on an optional route are not observed. The
	// collector of package metrics gives one (BridgeCollector.Observer).
	OnObserve func(route, would string)
}

// Encryption encrypts stored response bodies at rest with AES-GCM. Keys
// rotate by ID: new bodies use Current, older rows are read with the key
// whose ID they were stored under, so keep an old key in Keys until its rows
// have expired. A stored body whose key is gone is answered with a 500
// problem (replay-unavailable), never with the ciphertext.
type Encryption struct {
	// Keys maps a key ID (1 to 64 printable ASCII characters) to an AES key
	// of 16, 24 or 32 bytes.
	Keys map[string][]byte
	// Current is the ID of the key that encrypts new bodies.
	Current string
}

// KeyFormat restricts the keys a route accepts.
type KeyFormat uint8

// Key formats.
const (
	// KeyAny accepts any key of printable ASCII within the length limit.
	KeyAny KeyFormat = iota
	// KeyUUID accepts only UUIDs (8-4-4-4-12 hex digits, any version),
	// compared case-insensitively.
	KeyUUID
	// KeyUUIDv4 accepts only version 4 UUIDs, compared case-insensitively.
	KeyUUIDv4
)

// MismatchPolicy says what a known key with another request (another
// fingerprint) gets.
type MismatchPolicy uint8

// Mismatch policies.
const (
	// MismatchReject answers 422 (key-reused), as the IETF Idempotency-Key specification says.
	MismatchReject MismatchPolicy = iota
	// MismatchNewRequest treats the same key with another request as a new
	// request: the fingerprint becomes part of the ledger ID. Such a route
	// cannot share keys with consumers, whose IDs carry no fingerprint.
	MismatchNewRequest
)

// RouteConfig configures one route (or group of routes). Its zero values
// are the defaults; Scope is required. To share settings between routes,
// copy a RouteConfig value and change the copy.
type RouteConfig struct {
	// Scope is the ledger scope of the route's keys. A consumer or another
	// route naming the same scope shares dedupe with this one. Required.
	Scope string
	// Methods the route covers. Default POST and PATCH; PUT and DELETE may
	// be added; GET, HEAD, OPTIONS, TRACE and CONNECT never. Requests with
	// other methods pass through untouched.
	Methods []string
	// Required answers 400 (missing-key) to a covered request without a
	// key. Default false: such requests pass through without dedupe (still
	// in a transaction on transactional routes).
	Required bool
	// KeyFormat restricts the keys accepted. Default KeyAny.
	KeyFormat KeyFormat
	// MaxKeyLen is the longest key the route accepts, in bytes (1 to 255):
	// 128 for APIs whose contract says so, say. 0: Config.MaxKeyLen.
	// Principal isolation and MismatchNewRequest cap it (at 231, 238, and
	// 214 with both: see Config.MaxKeyLen).
	MaxKeyLen int
	// KeyValidator, when set, checks each key the route accepts otherwise
	// (after KeyFormat): a format such as
	// "{user}:{operation}:{resource}:{timestamp}". A key it refuses is
	// answered 400 (invalid-key) with its error's text as the problem's
	// detail: write it for the client, and without the key.
	KeyValidator func(key string) error
	// TTL is how long a key is remembered. 0: the ledger's default (24 h).
	// Every answer about a key says when it expires (Config.ExpiresHeader).
	TTL time.Duration
	// ResultTTL is how long the route's stored responses are kept, when
	// shorter than TTL: past it the key is still remembered (a retry does
	// not run the handler again, and a reuse with another request is
	// still 422 key-reused), but its response is no longer replayed and
	// the janitor clears it from the ledger. A retry then gets
	// StaleResponse's answer, else 422 (response-expired). 0: the
	// ledger's Config.ResultTTL (by default: as long as the key).
	ResultTTL time.Duration
	// StaleResponse, when set, answers a retry whose stored response is
	// gone (ResultTTL): typically the resource's current state (200), or
	// a 303 See Other to it. The bridge has set the replay and expiry
	// headers; r's body has been read (the key is in info). It returns
	// false, having written nothing, when it has no answer: the bridge
	// then answers 422 (response-expired).
	StaleResponse func(w http.ResponseWriter, r *http.Request, info StaleInfo) bool
	// Store decides which response statuses are stored (and their effect
	// committed). A status it refuses is rolled back: the handler's writes
	// are undone, the key stays free, and the client still gets the
	// response. Nil: DefaultStore.
	Store func(status int) bool
	// Mismatch policy. Default MismatchReject (422).
	Mismatch MismatchPolicy
	// FingerprintHeaders are request headers that take part in the
	// fingerprint (for example Content-Type variants or an API version
	// header). Default none.
	FingerprintHeaders []string
	// MaxBodyBytes caps the request body read for the fingerprint; a larger
	// body is answered 413 (body-too-large). Default 1 MiB.
	MaxBodyBytes int64
	// MaxResponseBytes caps the response body buffered and stored. A
	// transactional handler whose response is larger is rolled back and the
	// client gets 500 (response-too-large); see the package documentation.
	// Default 1 MiB.
	MaxResponseBytes int
	// LockWait is how long a duplicate waits for the request holding its
	// key to finish (then it gets the replay) before answering 409. No
	// connection is held while it waits. 0 (the default): answer 409 at
	// once.
	LockWait time.Duration
	// KeyRate, when set, limits how many new keys each tenant starts per
	// window on this route (see inbox.KeyRate): a new key over the limit
	// is answered 429 (key-rate-exceeded) with Retry-After, until the
	// window ends, and leaves nothing behind; replays are never limited.
	// The counts are in the ledger's Redis when it has one, else in
	// Postgres (migration 3).
	KeyRate *inbox.KeyRate
	// MaxLiveKeys, when set, limits each tenant's live keys in this scope:
	// a new key over the limit is answered 429 (quota-exceeded); replays are
	// still served. A limit of 0 or less means none. The count is taken
	// before the request runs, so concurrent requests may overshoot it
	// slightly.
	MaxLiveKeys func(tenant string) int64
	// Lease runs the handler outside a transaction, under a lease (for
	// effects outside the database, such as calling a payment provider):
	// Tx returns nil, FencingToken returns the lease's token. A crash
	// mid-handler lets the lease expire and a retry runs the handler again,
	// so the effect must itself be idempotent or fenced.
	Lease bool
	// Steps runs the handler in steps (inbox.Ledger.DoSteps), outside a
	// transaction, for work that spans Postgres and outside services: the
	// handler reaches the request's *inbox.Steps with Steps(ctx) (Tx
	// returns nil; FencingToken returns the lease's token) and records
	// each piece of work as a step, so that a retry with the same key
	// resumes after the steps recorded. A response whose status is stored
	// (Store) completes the key and is replayed to retries, as in lease
	// mode; one whose status is not stored is sent as it is and leaves the
	// recorded steps for the retry. FailSteps fails the key for good, after
	// the compensations the handler declared. A request without a key, on
	// an optional route, runs the handler without steps (Steps returns
	// nil). Not with Lease, Observe or KeyRate.
	Steps bool
	// LeaseDuration of lease-mode and steps routes; renewed while the
	// handler runs and while its result is recorded. 0: the ledger's
	// default (30 s).
	LeaseDuration time.Duration
	// PrincipalKeys says whether keys are isolated per principal when
	// Config.Principal names one. Default inbox.PrincipalIsolated; with
	// Config.Principal set, such routes accept keys of at most 231 bytes
	// (214 with MismatchNewRequest), as the ledger ID also holds the
	// principal's digest: on every request, also one whose principal is "".
	PrincipalKeys inbox.PrincipalPolicy
	// Observe runs the route as if the bridge were absent, to roll it out
	// without risk: every request reaches the handler as it came (no
	// refusal of a missing or invalid key, no replay, no 409 or 422, no
	// transaction from the bridge: Tx returns nil, and nothing is
	// buffered), while the ledger records each keyed request's key and
	// fingerprint, under the scope Scope + "~observe", so that
	// Config.OnObserve and the log say what enforcing would have done: a
	// missing or invalid key at WARN, a replay, a conflict or a mismatch
	// at INFO. Those keys never meet an enforcing
	// route's: switching the route to enforce starts from no keys.
	// KeyRate and MaxLiveKeys do not apply. Default false.
	Observe bool
}

// DefaultStore is the default storage policy: 2xx, 3xx and 4xx responses
// are stored, except 408, 409, 425 and 429 (the request may succeed if
// sent again); 1xx and 5xx are not. 3xx is stored too because refusing it
// would roll back a POST that answers 303 See Other.
func DefaultStore(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status >= 200 && status < 500
}

// Validate reports whether the Config is usable, treating zero values as
// their defaults. Errors match inbox.ErrConfig.
func (c Config) Validate() error {
	if c.Ledger == nil {
		return configErr("Ledger is nil")
	}
	for _, h := range append([]string{c.Header, c.ReplayHeader, c.LegacyReplayHeader, c.ExpiresHeader}, c.AltHeaders...) {
		if h != "" && !validHeaderName(h) {
			return configErr("invalid header name %q", h)
		}
	}
	for _, h := range c.DenyHeaders {
		if !validHeaderName(h) {
			return configErr("invalid header name %q in DenyHeaders", h)
		}
	}
	if c.MaxKeyLen < 0 || c.MaxKeyLen > 255 {
		return configErr("MaxKeyLen %d is outside 1..255", c.MaxKeyLen)
	}
	if c.RetryAfter < 0 {
		return configErr("RetryAfter is negative")
	}
	if c.AcquireWait < 0 {
		return configErr("AcquireWait is negative")
	}
	if c.HandlerTimeout < 0 {
		return configErr("HandlerTimeout is negative")
	}
	if c.Encryption != nil {
		if err := c.Encryption.validate(); err != nil {
			return err
		}
	}
	return nil
}

func (e *Encryption) validate() error {
	if err := e.ring().Validate(); err != nil {
		return configErr("Encryption: %v", err)
	}
	return nil
}

// Validate reports whether the RouteConfig is usable, treating zero values
// as their defaults. Errors match inbox.ErrConfig.
func (rc RouteConfig) Validate() error {
	if err := rc.spec().Validate(); err != nil {
		return configErr("RouteConfig: %v", err)
	}
	for _, m := range rc.Methods {
		switch m {
		case http.MethodPost, http.MethodPatch, http.MethodPut, http.MethodDelete:
		case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodConnect:
			return configErr("method %s is never idempotency-keyed", m)
		default:
			if !validHeaderName(m) { // a method is a token too
				return configErr("invalid method %q", m)
			}
		}
	}
	if rc.MaxKeyLen < 0 || rc.MaxKeyLen > 255 {
		return configErr("RouteConfig.MaxKeyLen %d is outside 1..255", rc.MaxKeyLen)
	}
	if rc.KeyFormat > KeyUUIDv4 {
		return configErr("unknown KeyFormat %d", rc.KeyFormat)
	}
	if rc.Mismatch > MismatchNewRequest {
		return configErr("unknown MismatchPolicy %d", rc.Mismatch)
	}
	for _, h := range rc.FingerprintHeaders {
		if !validHeaderName(h) {
			return configErr("invalid header name %q in FingerprintHeaders", h)
		}
	}
	switch {
	case rc.MaxBodyBytes < 0:
		return configErr("MaxBodyBytes is negative")
	case rc.MaxResponseBytes < 0:
		return configErr("MaxResponseBytes is negative")
	case rc.LeaseDuration < 0:
		return configErr("LeaseDuration is negative")
	case rc.LeaseDuration > 0 && !rc.Lease && !rc.Steps:
		return configErr("LeaseDuration is set but Lease and Steps are false")
	case rc.Steps && rc.Lease:
		return configErr("Steps and Lease: a route runs in one mode")
	case rc.Steps && rc.Observe:
		return configErr("Steps and Observe: an observed route runs its handler without the bridge")
	case rc.Steps && rc.KeyRate != nil:
		return configErr("Steps and KeyRate: a steps route does not limit its new keys")
	}
	return nil
}

// settings is a Config with its defaults applied.
type settings struct {
	Config
	keyHeaders []string // Header first, then AltHeaders
	deny       map[string]bool
	retryAfter string
	log        *slog.Logger // the ledger's
}

func newSettings(c Config) settings {
	if c.Header == "" {
		c.Header = defaultHeader
	}
	if c.AltHeaders == nil {
		c.AltHeaders = []string{"X-Idempotency-Key"}
	}
	if c.MaxKeyLen == 0 {
		c.MaxKeyLen = defaultMaxKeyLen
	}
	if c.ReplayHeader == "" {
		c.ReplayHeader = defaultReplayHeader
	}
	if c.ExpiresHeader == "" {
		c.ExpiresHeader = DefaultExpiresHeader
	}
	if c.RetryAfter == 0 {
		c.RetryAfter = defaultRetryAfter
	}
	if c.HandlerTimeout == 0 {
		c.HandlerTimeout = defaultHandlerTimeout
	}
	if c.AcquireWait == 0 {
		c.AcquireWait = DefaultAcquireWait
	}
	s := settings{Config: c, deny: map[string]bool{}, log: c.Ledger.Logger()}
	s.keyHeaders = append(s.keyHeaders, http.CanonicalHeaderKey(c.Header))
	for _, h := range c.AltHeaders {
		h = http.CanonicalHeaderKey(h)
		if !slices.Contains(s.keyHeaders, h) {
			s.keyHeaders = append(s.keyHeaders, h)
		}
	}
	for _, h := range alwaysDenied {
		s.deny[h] = true
	}
	for _, h := range c.DenyHeaders {
		s.deny[http.CanonicalHeaderKey(h)] = true
	}
	// The bridge's own headers are never stored.
	s.deny[http.CanonicalHeaderKey(c.ReplayHeader)] = true
	if c.LegacyReplayHeader != "" {
		s.deny[http.CanonicalHeaderKey(c.LegacyReplayHeader)] = true
	}
	s.deny[http.CanonicalHeaderKey(c.ExpiresHeader)] = true
	s.deny[encHeader] = true
	secs := (c.RetryAfter + time.Second - 1) / time.Second
	s.retryAfter = fmt.Sprint(int64(secs))
	return s
}

// alwaysDenied are never stored nor replayed: credentials, and hop-by-hop
// headers that belong to one connection.
var alwaysDenied = []string{
	"Set-Cookie", "Set-Cookie2", "Authorization", "Proxy-Authorization", "Proxy-Authenticate",
	"Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Date",
}

// spec is the route's key policy, as the bridges share it.
func (rc RouteConfig) spec() bridgereq.Spec {
	return bridgereq.Spec{Scope: rc.Scope, Source: Source, TTL: rc.TTL, ResultTTL: rc.ResultTTL, LockWait: rc.LockWait,
		Principal: rc.PrincipalKeys, NewRequest: rc.Mismatch == MismatchNewRequest,
		KeyRate: rc.KeyRate, Observe: rc.Observe}
}

// route is a RouteConfig with its defaults applied.
type route struct {
	RouteConfig
	spec      bridgereq.Spec
	methods   map[string]bool
	maxKeyLen int
	ttl       time.Duration // TTL, or the ledger's
}

func newRoute(rc RouteConfig, s *settings) route {
	if len(rc.Methods) == 0 {
		rc.Methods = []string{http.MethodPost, http.MethodPatch}
	}
	if rc.Store == nil {
		rc.Store = DefaultStore
	}
	if rc.MaxBodyBytes == 0 {
		rc.MaxBodyBytes = defaultMaxBodyBytes
	}
	if rc.MaxResponseBytes == 0 {
		rc.MaxResponseBytes = defaultMaxResponseBytes
	}
	rt := route{RouteConfig: rc, spec: rc.spec(), methods: map[string]bool{}}
	rt.spec.AcquireWait = s.AcquireWait
	for _, m := range rc.Methods {
		rt.methods[m] = true
	}
	rt.maxKeyLen = rt.spec.MaxKeyLen(cmp.Or(rc.MaxKeyLen, s.MaxKeyLen), s.Principal != nil)
	rt.ttl = cmp.Or(rc.TTL, s.Ledger.DefaultTTL())
	return rt
}

func configErr(format string, args ...any) error {
	return fmt.Errorf("%w: httpbridge: %s", inbox.ErrConfig, fmt.Sprintf(format, args...))
}

func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if !isTchar(s[i]) {
			return false
		}
	}
	return true
}

// isTchar reports an RFC 9110 token character.
func isTchar(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}
