package grpcbridge

import (
	"cmp"
	"context"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/justonce/justonce/grpcretry"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// Defaults.
const (
	// DefaultMetadataKey is the request metadata carrying the key, the
	// one grpcretry writes.
	DefaultMetadataKey = grpcretry.DefaultMetadataKey
	// DefaultFirstSentKey is the request metadata carrying first_sent
	// (RFC 3339) when the key comes from metadata, the one grpcretry
	// writes.
	DefaultFirstSentKey = grpcretry.DefaultFirstSentKey
	// DefaultReplayHeader is set to "true" in the header metadata of a
	// replayed response.
	DefaultReplayHeader = "idempotent-replayed"
	// DefaultField is the request message field of AEP-155, the one
	// grpcretry fills.
	DefaultField = grpcretry.DefaultField
	// DefaultRetryAfter is the delay in the RetryInfo of retryable answers.
	DefaultRetryAfter = time.Second
	// DefaultAcquireWait is how long a call waits for a database
	// connection before it is shed with Unavailable (Config.AcquireWait).
	DefaultAcquireWait = bridgereq.DefaultAcquireWait
	// DefaultHandlerTimeout bounds a keyed handler's run.
	DefaultHandlerTimeout = time.Minute
	// DefaultClockSkew is the clock difference between clients and servers
	// that first_sent checks allow.
	DefaultClockSkew = time.Minute
	// DefaultExpiresKey is the trailer metadata that says until when the
	// call's key is remembered, the one grpcretry reads.
	DefaultExpiresKey = grpcretry.DefaultExpiresKey
	// DefaultMinTTL is the shortest TTL New accepts for a method without
	// MethodConfig.AllowShortTTL: AEP-155 asks servers to honour keys for
	// at least an hour.
	DefaultMinTTL = time.Hour
)

// Config configures a Bridge: the ledger, what every method shares, and
// the per-method policies. The zero value of every field but Ledger and
// Methods is a working default.
type Config struct {
	// Ledger records the calls, in the same processed_events table the
	// consumers and the HTTP bridge use. It is also the logger's source
	// (Ledger.Logger). Required.
	Ledger *inbox.Ledger

	// Methods maps a full method name ("/pkg.Service/Method") or a whole
	// service ("/pkg.Service/*") to its policy. An exact name wins over
	// its service. Methods not listed pass through untouched.
	Methods map[string]MethodConfig

	// MetadataKey names the request metadata carrying the key. Default
	// "idempotency-key".
	MetadataKey string
	// FirstSentKey names the request metadata carrying first_sent, an RFC
	// 3339 time, for methods taking the key from metadata. Default
	// "idempotency-first-sent".
	FirstSentKey string
	// ReplayHeader is set to "true" in the header metadata of replayed
	// answers. Default "idempotent-replayed".
	ReplayHeader string
	// DenyMetadata are header and trailer metadata keys never stored nor
	// replayed, in addition to the credentials always denied:
	// authorization, proxy-authorization, cookie, set-cookie. The first
	// answer still carries them.
	DenyMetadata []string

	// Tenant returns the call's tenant, typically from the auth
	// information an earlier interceptor put in ctx. Keys never match
	// across tenants. Nil: no tenants (""), which is also what consumers
	// use.
	Tenant func(ctx context.Context) string
	// Principal returns who sent the call (a user or client ID). It is
	// recorded for audit and, by default, isolates keys per principal
	// (MethodConfig.PrincipalKeys). Nil, or "" for a call: keys are shared
	// by every caller of the tenant.
	Principal func(ctx context.Context) string

	// RetryAfter is the delay put in the RetryInfo of Aborted (in flight)
	// and Unavailable (store down, overloaded) answers. Default 1 s.
	RetryAfter time.Duration
	// AcquireWait bounds how long a call waits for a connection from the
	// ledger's pool, where calls queue when the database cannot keep up.
	// When it runs out (every connection in use), the call is shed:
	// its handler does not run, nothing is recorded, and the client gets
	// Unavailable with ErrorInfo OVERLOADED and RetryInfo (RetryAfter);
	// its retry with the same key runs once. Default DefaultAcquireWait
	// (1 s). It is checked before each ledger claim, and for a keyless
	// call before its transaction begins.
	AcquireWait time.Duration
	// HandlerTimeout bounds a keyed call's handler and ledger work. Keyed
	// handlers run on a context that does not end when the client cancels
	// or its deadline passes, so that work a client started is finished
	// and recorded, and its retry gets the replay. Default 1 minute.
	HandlerTimeout time.Duration
	// ClockSkew is how far a client's clock may differ from the server's
	// in first_sent checks. Default 1 minute.
	ClockSkew time.Duration

	// ExpiresKey names the trailer metadata that tells the client until
	// when its key is remembered, an RFC 3339 time rounded down to the
	// second: past it a call with the key runs as a new one. It is on
	// every answer that concerns a recorded key: a first run whose answer
	// was stored, a replay, a call in flight (then a lower bound: the
	// key's first call is at most HandlerTimeout old), a key reused with
	// another request, a key run elsewhere or failed. A trailer, so that
	// error answers carry it too. grpcretry stops retrying a key once it
	// has expired. Default DefaultExpiresKey ("idempotency-key-expires").
	ExpiresKey string
	// MaxKeyLen is the longest key accepted, in bytes (1 to 255). Default
	// 255. KeyAEP methods take at most 36, and methods that isolate keys
	// per principal at most 231 (see KeyAny).
	MaxKeyLen int
	// MinTTL is the shortest TTL (MethodConfig.TTL, or the ledger's
	// default) New accepts for a method, unless the method sets
	// AllowShortTTL: AEP-155's minimum lifetime. Default DefaultMinTTL (1
	// hour).
	MinTTL time.Duration

	// LegacyFingerprints stores fingerprints as releases before detailed
	// fingerprints did (a digest of the whole call, 33 bytes): an
	// IDEMPOTENCY_KEY_REUSED answer then names no differences. Set it
	// while instances of such a release serve the same ledger (a rolling
	// upgrade); unset it once every instance runs this release. Keys
	// stored that way are always recognised.
	LegacyFingerprints bool

	// OnObserve, when set, is told what an observe-mode method
	// (MethodConfig.Observe) would have done with each call it let
	// through: the full method name and one of
	//
	//	would_run                 a new key: the handler would have run, as it did
	//	would_replay              a known key (completed, failed for good, or run by a
	//	                          consumer or over HTTP): answered from the ledger
	//	would_refuse_missing_key  no key on a Required method: InvalidArgument
	//	would_refuse_invalid_key  a key or first_sent the method refuses: InvalidArgument
	//	would_conflict            a key in flight: Aborted
	//	would_mismatch            a known key with another request: IDEMPOTENCY_KEY_REUSED
	//
	// Calls without a key on an optional method are not observed. The
	// collector of package metrics gives one (BridgeCollector.Observer).
	OnObserve func(method, would string)
}

// KeySource says where a method's key is read.
type KeySource uint8

// Key sources.
const (
	// KeyFromMetadata reads the key from Config.MetadataKey and first_sent
	// from Config.FirstSentKey.
	KeyFromMetadata KeySource = iota
	// KeyFromMessage reads the key from a field of the request message
	// (AEP-155): the message's IdempotencyKey method when it has one
	// (KeyedRequest), else the field named MethodConfig.Field, a message
	// with a string "key" and a google.protobuf.Timestamp "first_sent"
	// (aep.api.IdempotencyKey), or a plain string field.
	KeyFromMessage
)

// KeyFormat restricts the keys a method accepts.
type KeyFormat uint8

// Key formats.
const (
	// KeyAny accepts printable ASCII, 1 to MaxKeyLen bytes (255 by
	// default); at most 231 on a method that isolates keys per principal
	// (Config.Principal set and MethodConfig.PrincipalKeys
	// inbox.PrincipalIsolated, the default), as the ledger ID also holds
	// the principal's digest. The limit is the
	// method's: it holds on every call, also one whose principal is "".
	KeyAny KeyFormat = iota
	// KeyUUID accepts only UUIDs (8-4-4-4-12 hex digits, any version),
	// compared case-insensitively.
	KeyUUID
	// KeyAEP accepts printable ASCII of 1 to 36 bytes, AEP-155's limit.
	KeyAEP
)

// MethodConfig is the policy of one method (or service). Its zero values
// are the defaults; Scope is required.
type MethodConfig struct {
	// Scope is the ledger scope of the method's keys. An HTTP route or a
	// consumer naming the same scope shares dedupe with it. Required.
	Scope string
	// Off lets the method pass through untouched (to exempt one method of
	// a service listed as "/pkg.Service/*").
	Off bool
	// Required answers InvalidArgument to a call without a key. Default
	// false: such calls run without dedupe, in a plain transaction.
	Required bool
	// Key says where the key is read. Default KeyFromMetadata.
	Key KeySource
	// Field names the request field holding the key for KeyFromMessage.
	// Default "idempotency_key". The field is cleared from the message
	// before fingerprinting, so retries with another first_sent still
	// match.
	Field string
	// KeyFormat restricts the keys accepted. Default KeyAny.
	KeyFormat KeyFormat
	// MaxKeyLen is the longest key the method accepts, in bytes (1 to
	// 255): 128 for APIs whose contract says so, say. 0: Config.MaxKeyLen.
	MaxKeyLen int
	// KeyValidator, when set, checks each key the method accepts
	// otherwise (after KeyFormat): a format such as
	// "{user}:{operation}:{resource}:{timestamp}". A key it refuses is
	// answered InvalidArgument (IDEMPOTENCY_KEY_INVALID) with its error's
	// text as the message and the BadRequest description: write it for
	// the client, and without the key.
	KeyValidator func(key string) error
	// RequireFirstSent answers InvalidArgument to a keyed call without
	// first_sent. Default false.
	RequireFirstSent bool
	// TTL is how long a key is remembered. 0: the ledger's default (24 h).
	// New refuses a TTL under Config.MinTTL (1 hour, AEP-155's minimum)
	// unless AllowShortTTL. Every answer about a key says when it expires
	// (Config.ExpiresKey).
	TTL time.Duration
	// ResultTTL is how long the method's stored answers are kept, when
	// shorter than TTL: past it the key is still remembered (a retry does
	// not run the handler again, and a reuse with another request is
	// still IDEMPOTENCY_KEY_REUSED), but its answer is no longer replayed
	// and the janitor clears it from the ledger. A retry then gets
	// StaleResponse's answer, else AlreadyExists (RESPONSE_EXPIRED).
	// 0: the ledger's Config.ResultTTL (by default: as long as the key).
	ResultTTL time.Duration
	// StaleResponse, when set, answers a retry whose stored answer is
	// gone (ResultTTL): typically the resource's current state, as the
	// method's response message (AEP-155 lets a server answer a stale
	// success so). req is the retry's request message. A nil response
	// and nil error mean it has no answer: the bridge then answers
	// AlreadyExists (RESPONSE_EXPIRED); an error is answered as it is.
	StaleResponse func(ctx context.Context, req any, info StaleInfo) (any, error)
	// AllowShortTTL lets the method's TTL be under Config.MinTTL, for a
	// method whose clients are told, and retry within, a shorter window.
	AllowShortTTL bool
	// KeyRate, when set, limits how many new keys each tenant starts per
	// window on this method (see inbox.KeyRate): a new key over the limit
	// is answered ResourceExhausted (KEY_RATE_EXCEEDED) with a RetryInfo
	// delay until the window ends, and leaves nothing behind; replays are
	// never limited.
	KeyRate *inbox.KeyRate
	// Observe runs the method as if the bridge were absent, to roll it out
	// without risk: every call reaches the handler as it came (no refusal
	// of a missing or invalid key or first_sent, no replay, no Aborted, no
	// transaction from the bridge: Tx returns nil, and the handler's
	// metadata goes out as it sets it), while the ledger records each
	// keyed call's key and fingerprint, under the scope Scope + "~observe",
	// so that Config.OnObserve and the log say what enforcing would have
	// done: a missing or invalid key at WARN, a replay, a conflict or a
	// mismatch at INFO. KeyRate does not apply.
	Observe bool
	// Steps runs the handler in steps (inbox.Ledger.DoSteps), outside a
	// transaction, for work that spans Postgres and outside services: the
	// handler reaches the call's *inbox.Steps with Steps(ctx) (Tx returns
	// nil) and records each piece of work as a step, so that a retry with
	// the same key resumes after the steps recorded. An answer whose code
	// is stored (Store) completes the key and is replayed to retries; one
	// whose code is not stored is sent as it is and leaves the recorded
	// steps for the retry. An error marked inbox.Permanent fails the key
	// for good, after the compensations the handler declared
	// (Steps.Compensate); the client gets the error, and retries
	// FailedPrecondition (KEY_FAILED). A call without a key,
	// on an optional method, runs the handler without steps (Steps
	// returns nil). Not with Observe or KeyRate.
	Steps bool
	// LeaseDuration of a steps method's lease (Steps), renewed while the
	// handler runs. 0: the ledger's default (30 s).
	LeaseDuration time.Duration
	// LockWait is how long a duplicate waits for the call holding its key
	// to finish (then it gets the replay) before answering Aborted. 0:
	// answer at once.
	LockWait time.Duration
	// Store decides which status codes are stored (and the handler's
	// writes committed). A code it refuses rolls back: the handler's
	// writes are undone, the key stays free, the client still gets the
	// answer. Nil: DefaultStore.
	Store func(code codes.Code) bool
	// FingerprintMetadata names request metadata that take part in the
	// fingerprint (an API version, say). Default none.
	FingerprintMetadata []string
	// PrincipalKeys says whether keys are isolated per principal when
	// Config.Principal is set. Default inbox.PrincipalIsolated: the ledger
	// ID of a call with a principal is inbox.PrincipalKeyID(key,
	// principal), the one the HTTP bridge uses, and the method takes keys
	// of at most 231 bytes, on every call, also one whose principal is "".
	// inbox.PrincipalShared keys calls by the key alone, the principal
	// being recorded for audit only: for methods whose keys are shared with
	// a consumer.
	PrincipalKeys inbox.PrincipalPolicy
}

// DefaultStore is the default storage policy: OK and the answers that
// would be the same if the call were sent again are stored
// (InvalidArgument, NotFound, AlreadyExists, PermissionDenied,
// FailedPrecondition, OutOfRange, Unimplemented, Unauthenticated).
// Transient or server-side failures release the key: Unavailable,
// Internal, DeadlineExceeded, Canceled, Unknown (a plain Go error),
// Aborted, ResourceExhausted, DataLoss.
func DefaultStore(code codes.Code) bool {
	switch code {
	case codes.OK, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented, codes.Unauthenticated:
		return true
	}
	return false
}

// Validate reports whether the Config is usable. Errors match
// inbox.ErrConfig.
func (c Config) Validate() error {
	if c.Ledger == nil {
		return configErr("Ledger is nil")
	}
	if len(c.Methods) == 0 {
		return configErr("Methods is empty")
	}
	for name, mc := range c.Methods {
		if !validMethodName(name) {
			return configErr("method name %q is not \"/pkg.Service/Method\" nor \"/pkg.Service/*\"", name)
		}
		if err := mc.validate(); err != nil {
			return fmt.Errorf("%w (method %s)", err, name)
		}
	}
	for _, k := range []string{c.MetadataKey, c.FirstSentKey, c.ReplayHeader, c.ExpiresKey} {
		if k != "" && !validMetadataKey(k) {
			return configErr("invalid metadata key %q", k)
		}
	}
	switch {
	case c.RetryAfter < 0:
		return configErr("RetryAfter is negative")
	case c.AcquireWait < 0:
		return configErr("AcquireWait is negative")
	case c.HandlerTimeout < 0:
		return configErr("HandlerTimeout is negative")
	case c.ClockSkew < 0:
		return configErr("ClockSkew is negative")
	case c.MinTTL < 0:
		return configErr("MinTTL is negative")
	case c.MaxKeyLen < 0 || c.MaxKeyLen > inbox.MaxPartLen:
		return configErr("MaxKeyLen %d is outside 1..255", c.MaxKeyLen)
	}
	return nil
}

func (mc MethodConfig) validate() error {
	if mc.Off {
		return nil
	}
	if err := mc.spec().Validate(); err != nil {
		return configErr("%v", err)
	}
	switch {
	case mc.Key > KeyFromMessage:
		return configErr("unknown KeySource %d", mc.Key)
	case mc.KeyFormat > KeyAEP:
		return configErr("unknown KeyFormat %d", mc.KeyFormat)
	case mc.Field != "" && mc.Key != KeyFromMessage:
		return configErr("Field is set but Key is not KeyFromMessage")
	case mc.MaxKeyLen < 0 || mc.MaxKeyLen > inbox.MaxPartLen:
		return configErr("MaxKeyLen %d is outside 1..255", mc.MaxKeyLen)
	case mc.LeaseDuration < 0:
		return configErr("LeaseDuration is negative")
	case mc.LeaseDuration > 0 && !mc.Steps:
		return configErr("LeaseDuration is set but Steps is false")
	case mc.Steps && mc.Observe:
		return configErr("Steps and Observe: an observed method runs its handler without the bridge")
	case mc.Steps && mc.KeyRate != nil:
		return configErr("Steps and KeyRate: a steps method does not limit its new keys")
	}
	for _, k := range mc.FingerprintMetadata {
		if !validMetadataKey(k) {
			return configErr("invalid metadata key %q in FingerprintMetadata", k)
		}
	}
	return nil
}

func validMethodName(s string) bool {
	if !strings.HasPrefix(s, "/") {
		return false
	}
	svc, m, ok := strings.Cut(s[1:], "/")
	return ok && svc != "" && m != "" && !strings.Contains(m, "/")
}

// validMetadataKey: lower-case letters, digits, '-', '_', '.', as gRPC
// metadata keys are; binary ("-bin") keys are not keys of this kind.
func validMetadataKey(s string) bool {
	if s == "" || strings.HasSuffix(s, "-bin") || strings.HasPrefix(s, "grpc-") {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('a' <= c && c <= 'z' || '0' <= c && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

func configErr(format string, args ...any) error {
	return fmt.Errorf("%w: grpcbridge: %s", inbox.ErrConfig, fmt.Sprintf(format, args...))
}

// spec is the method's key policy, as the bridges share it.
func (mc MethodConfig) spec() bridgereq.Spec {
	return bridgereq.Spec{Scope: mc.Scope, Source: Source, TTL: mc.TTL, ResultTTL: mc.ResultTTL, LockWait: mc.LockWait,
		Principal: mc.PrincipalKeys,
		KeyRate:   mc.KeyRate, Observe: mc.Observe}
}

// method is a MethodConfig with its defaults applied.
type method struct {
	MethodConfig
	spec      bridgereq.Spec
	maxKeyLen int
	ttl       time.Duration // TTL, or the ledger's; set by New
}

func newMethod(mc MethodConfig, c *Config) *method {
	if mc.Store == nil {
		mc.Store = DefaultStore
	}
	if mc.Key == KeyFromMessage && mc.Field == "" {
		mc.Field = DefaultField
	}
	limit := cmp.Or(mc.MaxKeyLen, c.MaxKeyLen, inbox.MaxPartLen)
	if mc.KeyFormat == KeyAEP {
		limit = min(limit, 36)
	}
	m := &method{MethodConfig: mc, spec: mc.spec()}
	m.spec.AcquireWait = c.AcquireWait
	m.maxKeyLen = m.spec.MaxKeyLen(limit, c.Principal != nil)
	return m
}
