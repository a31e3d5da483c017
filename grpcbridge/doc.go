// Package grpcbridge gives unary gRPC methods idempotency keys, on the same
// processed_events ledger (package inbox) that the consumers and the HTTP
// bridge use: an RPC, an HTTP request and an event with the same key in
// the same scope run once between them.
//
// # Server side
//
// Make a Bridge on a ledger, name the methods it covers, and install its
// interceptor (inside recovery, after authentication):
//
//	bridge, err := grpcbridge.New(grpcbridge.Config{
//		Ledger: ledger,
//		Methods: map[string]grpcbridge.MethodConfig{
//			"/shop.v1.Orders/CreateOrder": {Scope: "orders", Required: true},
//			"/shop.v1.Books/*":            {Scope: "books", Key: grpcbridge.KeyFromMessage},
//		},
//	})
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(recovery, auth, bridge.UnaryServerInterceptor()))
//
//	func (s *server) CreateOrder(ctx context.Context, in *pb.CreateOrderRequest) (*pb.Order, error) {
//		tx := grpcbridge.Tx(ctx) // the ledger's transaction
//		...
//	}
//
// Methods not listed pass through untouched. A covered call with a key
// runs like this:
//
//  1. The key is read: from the request metadata "idempotency-key"
//     (Config.MetadataKey), with an optional "idempotency-first-sent" (RFC
//     3339), or, with KeyFromMessage, from the AEP-155 field of the request
//     message ("idempotency_key": an aep.api.IdempotencyKey-shaped message
//     with a key and a first_sent Timestamp, or a string), found through
//     the KeyedRequest method or protoreflect. Keys are printable ASCII of
//     1 to 255 bytes (KeyAny), UUIDs only (KeyUUID), or at most 36 bytes
//     (KeyAEP, AEP-155's limit). A method that isolates keys per principal
//     (see below) takes at most 231 bytes, as the ledger ID also holds
//     the principal's digest: on every call, also one whose principal is
//     "". Without a key the call runs without dedupe, in a plain
//     transaction, or is refused when the method is Required.
//  2. first_sent, when given, is checked (see First sent).
//  3. The fingerprint is computed: a versioned SHA-256 of the full method
//     name, the request's deterministic protobuf encoding with the
//     idempotency field cleared (so retries with another first_sent still
//     match), and the MethodConfig.FingerprintMetadata, followed by short
//     digests of each field (by JSON pointer over the message's JSON
//     mapping, "message:/quantity") and metadata key, so that a key
//     reused with another request can be told what differs.
//  4. The ledger claims the key (scope, tenant, key) in a transaction and
//     runs the handler in it; the handler gets it from Tx. The answer
//     (response message or status, with the header and trailer metadata
//     the handler set) is stored in the same transaction and sent only
//     after the commit.
//
// A keyed handler runs on a context that does not end when the client
// cancels or its deadline passes (bounded by Config.HandlerTimeout
// instead): the work is finished, committed and stored, and the client's
// retry gets the replay. Nothing is lost and nothing runs twice.
//
// # Answers
//
// Errors the bridge answers itself carry an ErrorInfo (domain "justonce")
// whose reason names the case, plus a BadRequest naming the metadata key
// or field, or a RetryInfo for retryable ones:
//
//	case                                 code                details
//	missing key on a Required method     InvalidArgument     IDEMPOTENCY_KEY_MISSING, BadRequest
//	invalid key (format, length, twice)  InvalidArgument     IDEMPOTENCY_KEY_INVALID, BadRequest
//	first_sent in the future             InvalidArgument     FIRST_SENT_IN_FUTURE, BadRequest
//	first_sent expired                   InvalidArgument     FIRST_SENT_EXPIRED, BadRequest
//	first_sent other than the first's    InvalidArgument     FIRST_SENT_CHANGED, BadRequest
//	first_sent unreadable / missing      InvalidArgument     FIRST_SENT_INVALID / FIRST_SENT_MISSING
//	same key, call in flight             Aborted             REQUEST_IN_PROGRESS, RetryInfo
//	same key, another request            InvalidArgument     IDEMPOTENCY_KEY_REUSED (metadata differences), BadRequest
//	same key, same request, completed    the stored answer   header metadata idempotent-replayed: true
//	key run by a consumer or over HTTP   AlreadyExists       ALREADY_PROCESSED (metadata source), replayed
//	key a consumer dead-lettered         FailedPrecondition  KEY_FAILED (metadata source), replayed
//	answer past MethodConfig.ResultTTL   AlreadyExists       RESPONSE_EXPIRED (metadata completed_at), replayed
//	store unavailable                    Unavailable         STORE_UNAVAILABLE, RetryInfo
//	overloaded (no connection in time)   Unavailable         OVERLOADED, RetryInfo
//	handler's transaction not committed  Internal            NOT_COMMITTED
//	new key over MethodConfig.KeyRate    ResourceExhausted   KEY_RATE_EXCEEDED, RetryInfo
//
// Every answer about a recorded key carries, in its trailer metadata, when
// the key expires ("idempotency-key-expires", RFC 3339; Config.ExpiresKey):
// past it the same key runs as a new call, so grpcretry stops retrying a
// key there. The differences of IDEMPOTENCY_KEY_REUSED ("message:/item",
// "metadata:api-version") are in its ErrorInfo metadata "differences" and
// its BadRequest violations, never the values. Refused keys are logged at
// WARN and replays at INFO, with the peer's address and user agent, keys
// masked.
//
// A key reused with another request is InvalidArgument rather than
// AlreadyExists: the call as sent is wrong and will never succeed, and
// clients commonly read AlreadyExists on a create as "it was done", which
// would tell a client whose different request never ran that it did.
// AlreadyExists is kept for a key another front ran: that operation did
// happen. In flight is Aborted, the code for a concurrency conflict that a
// retry resolves, with the delay in RetryInfo (Config.RetryAfter);
// MethodConfig.LockWait makes the duplicate wait for the replay instead.
//
// # What is stored
//
// MethodConfig.Store decides, by code. DefaultStore keeps OK and the codes
// a retry would get again (InvalidArgument, NotFound, AlreadyExists,
// PermissionDenied, FailedPrecondition, OutOfRange, Unimplemented,
// Unauthenticated): the handler's writes commit with the ledger row and
// the answer, and retries replay it. Every other code, Unavailable,
// Internal, DeadlineExceeded, Canceled, Unknown (a plain Go error),
// Aborted, ResourceExhausted and DataLoss among them, rolls back: the
// writes are undone, the key is free, the client still gets the answer,
// and a retry runs again. A panic rolls back too and is re-raised for a
// recovery interceptor. A plain error from a handler whose database
// connection died is answered Unavailable.
//
// The replay is the stored response message, decoded into its registered
// type (re-encoded, it is byte for byte the first answer for messages
// without map fields, whose order protobuf leaves free), or the stored
// status with its message and details; the header and trailer metadata
// the handler set come back too, with "idempotent-replayed: true" added to
// the header, except credentials (authorization, proxy-authorization,
// cookie, set-cookie) and Config.DenyMetadata, which are never stored.
//
// # First sent
//
// AEP-155's first_sent says when the client first sent the key. With
// Config.ClockSkew (default 1 minute) allowed for clocks that differ:
//
//   - later than now + ClockSkew: in the future, refused;
//   - earlier than now - (TTL - ClockSkew): expired, refused. The ledger
//     keeps a key for the method's TTL (the ledger's default, 24 h, when
//     0) from when it first saw it, which is no earlier than first_sent -
//     ClockSkew; past that point the key may be forgotten, and honouring it
//     could run the call twice. AEP-155 asks for at least an hour of TTL:
//     New refuses a method whose TTL is under Config.MinTTL (an hour)
//     unless it sets AllowShortTTL.
//   - a retry whose first_sent differs from the one stored with the key's
//     answer: refused (FIRST_SENT_CHANGED).
//
// Calls without first_sent are accepted unless MethodConfig.RequireFirstSent.
//
// # Other fronts on one ledger
//
// A method and an HTTP route or a consumer that name the same scope (and
// tenant) share keys. A key first run by another front is not run again:
// the call gets AlreadyExists (ALREADY_PROCESSED, with the source in the
// ErrorInfo metadata), as there is no gRPC response to replay. The HTTP
// bridge, finding a key run over gRPC, answers as for a key a consumer ran
// (200, already_processed, with the source) without running it; consumers
// answer it as a duplicate. With Config.Principal, keys are isolated per
// principal as in the HTTP bridge (MethodConfig.PrincipalKeys:
// inbox.PrincipalIsolated, the default), under the same ledger ID
// (inbox.PrincipalKeyID), so that one principal's key dedupes across the
// two; a method whose keys are shared with a consumer sets
// inbox.PrincipalShared.
//
// # Steps
//
// MethodConfig.Steps runs a method's handler in steps
// (inbox.Ledger.DoSteps) instead of a transaction, for work that spans
// Postgres and outside services: the handler records its work as steps
// through Steps(ctx), a retry with the key resumes after the steps
// recorded, a stored answer completes the key and is replayed, and an
// error marked inbox.Permanent fails the key for good after the declared
// compensations.
//
// # Rolling out
//
// MethodConfig.Observe runs a method as if the bridge were absent: every
// call reaches the handler as it came, while the ledger records keys and
// fingerprints (under the scope Scope + "~observe") so that the log and
// Config.OnObserve (a metric of package metrics) say what enforcing would
// have done.
//
// # Client side
//
// The client half is package grpcretry, which links no database driver:
// its UnaryClientInterceptor gives calls without a key a UUID v4 key and
// first_sent, in the request's AEP-155 field when it has one (on a copy)
// and otherwise in the metadata this package reads by default, and
// retries Aborted, Unavailable, ResourceExhausted, Internal, Unknown and
// DeadlineExceeded (while the caller's context lives) with the same key,
// honouring RetryInfo, until the key's expiry is near
// (grpcretry.ErrOutcomeUnknown).
package grpcbridge
