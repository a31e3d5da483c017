// Package httpbridge gives net/http endpoints the Idempotency-Key behaviour
// of draft-ietf-httpapi-idempotency-key-header, on the same processed_events
// ledger (package inbox) the Kafka and NATS consumers use: an API request
// and an event with the same key in the same scope run once between them.
//
// # Server side
//
// Make a Bridge on a ledger and wrap each route with Bridge.Route. The
// middleware is a func(http.Handler) http.Handler, so it works with the
// standard mux, chi and gorilla as is:
//
//	bridge, err := httpbridge.New(httpbridge.Config{Ledger: ledger})
//	orders := bridge.Route(httpbridge.RouteConfig{Scope: "orders", Required: true})
//	mux.Handle("POST /orders", orders(http.HandlerFunc(createOrder)))
//
//	func createOrder(w http.ResponseWriter, r *http.Request) {
//		tx := httpbridge.Tx(r.Context()) // the ledger's transaction
//		_, err := tx.Exec(r.Context(), `INSERT INTO orders ...`)
//		...
//		w.WriteHeader(http.StatusCreated)
//	}
//
// A covered request (POST and PATCH by default) with a key runs like this:
//
//  1. The key header is parsed: a structured-field string ("abc") or a bare
//     value (abc) of printable ASCII, 1 to 255 characters. Lists, repeated
//     headers, empty keys, longer keys and other characters get 400
//     (invalid-key). X-Idempotency-Key is accepted too (Config.AltHeaders).
//     Without a key the request passes through, or gets 400 (missing-key)
//     when the route is Required.
//  2. The body is read, up to RouteConfig.MaxBodyBytes (413 body-too-large
//     over it), and handed on to the handler intact.
//  3. The fingerprint is computed: a versioned SHA-256 of the method, path,
//     sorted query, media type, canonical body (JSON with object keys sorted
//     recursively and numbers kept exactly as written; urlencoded forms with
//     fields sorted; anything else raw) and the RouteConfig.FingerprintHeaders.
//  4. The ledger claims the key (scope, tenant, key) in a transaction and
//     runs the handler in it; the handler gets that transaction from Tx.
//     The response is buffered, stored in the same transaction, and written
//     to the client only after the commit.
//
// What the client gets:
//
//   - first request: the handler's response, as it wrote it;
//   - same key, same request, completed: the stored status, headers and body,
//     byte for byte, with Idempotent-Replayed: true (and
//     Config.LegacyReplayHeader, for example X-Idempotency-Replay);
//   - same key while the first is still running: 409 (request-in-progress)
//     with Retry-After, unless RouteConfig.LockWait lets it wait for the
//     replay;
//   - same key, another request: 422 (key-reused), or, with
//     MismatchNewRequest, a new request;
//   - same key from another principal (Config.Principal): a request of its
//     own (see Principals);
//   - the handler answered success but its transaction did not commit: 500
//     (not-committed); nothing is stored and the key is free;
//   - database unreachable: 503 (store-unavailable) with Retry-After;
//     nothing is recorded, and a retry with the same key is safe.
//
// Errors the bridge answers itself are application/problem+json (RFC 9457)
// with stable type URIs (the Problem constants). Keys are masked in logs
// (550e****0000).
//
// # What is stored
//
// RouteConfig.Store decides, by status; DefaultStore keeps 2xx, 3xx and 4xx
// except 408, 409, 425 and 429. A kept status commits the handler's writes
// with the ledger row and the stored response. Any other status (5xx by
// default) rolls the transaction back: the handler's writes are undone, no
// row is left, the key is free, and the client still gets the handler's
// response; a retry runs the handler again. A panic rolls back too and is
// re-raised for the server or an outer recovery middleware.
//
// # Failures: what is stored, what releases the key
//
// Only a transaction that committed is ever answered as stored success.
// On a transactional route:
//
//	outcome                                          answer                            ledger
//	kept status (DefaultStore: 2xx-4xx), COMMIT ok   the handler's response            stored; retries replay it
//	status not kept (5xx by default)                 the handler's response            rolled back; key free
//	panic                                            re-raised                         rolled back; key free
//	response over MaxResponseBytes                   500 response-too-large            rolled back; key free
//	handler ignored a failed statement, answered     500 not-committed                 rolled back; key free
//	  success (the transaction was aborted, so
//	  COMMIT rolled back: inbox.ErrRolledBack)
//	COMMIT refused: a deferred constraint (23xxx)    500 not-committed                 rolled back; key free
//	  or another non-transient error at COMMIT
//	store unavailable or a lost race (transient:     503 store-unavailable,            not stored; key free
//	  inbox.IsTransient), before or at COMMIT          Retry-After
//	connection lost while COMMIT was in flight       503 store-unavailable,            stored or not: the retry
//	  (inbox.ErrCommitUnknown)                         Retry-After                       gets the replay, or runs
//	another ledger error                             500                               not stored; key free
//
// A not-committed answer is the handler's failure, like a 5xx it answers
// itself: a retry with the same key runs again, and fails the same way until
// the cause is fixed. Its detail says what failed without SQL details; the
// log (Config.Logger) has the database's error. Handle an expected SQL error
// inside a savepoint (tx.Begin) to go on after it. Requests without a key
// on an optional route get the same answers for their plain transaction.
//
// Lease-mode routes are in the Lease mode section.
//
// Set-Cookie, Authorization, Proxy-Authorization, hop-by-hop headers and
// Config.DenyHeaders are never stored nor replayed; the first response
// still carries them. Stored bodies may be encrypted at rest (Encryption,
// AES-GCM with key IDs for rotation). The Redis replay cache, when the
// ledger has one, holds the same (encrypted) form.
//
// Response size: the response is buffered up to RouteConfig.MaxResponseBytes
// (1 MiB by default). A larger response cannot be stored, and sending it
// without storing it would break the promise that a retry gets the same
// answer, so the request fails loudly instead of truncating: on a
// transactional route it is rolled back (nothing happened, the key is free)
// and the client gets 500 (response-too-large); a retry fails the same way
// until the cap is raised. On a lease-mode route the effect already
// happened outside the database: the key is marked failed so that it never
// runs again, the client gets 500 (response-too-large) and retries get 422
// (key-failed).
//
// # Client disconnects
//
// A keyed handler runs on a context that does not end when the client goes
// away (bounded by Config.HandlerTimeout instead): the work is finished,
// committed and stored, and the client's retry gets the replay (or 409
// while it still runs). Nothing is lost and nothing runs twice. Requests
// without a key keep the client's context.
//
// # Principals
//
// With Config.Principal set, keys are isolated per principal by default
// (RouteConfig.PrincipalKeys, PrincipalIsolated), like per-account keys in
// payment APIs: the ledger ID of a request with a principal is
// PrincipalKeyID(key, principal), the key followed by U+00B7 and a digest
// of the principal. A key replays only to the principal that sent it.
// Another principal sending the same key, even with the same body, gets a
// request of its own: its handler runs, and its answer (including 409 while
// a request is in flight) depends only on its own requests, so it never
// learns whether someone else used the key. No refusal mode is offered,
// because refusing a key that another principal holds would reveal that the
// key exists.
//
// Requests for which Principal returns "" keep the plain key. Isolated
// routes accept keys of at most 231 bytes (214 with MismatchNewRequest).
// RouteConfig{PrincipalKeys: PrincipalShared} keys by the plain key for
// every principal of the tenant (the principal is recorded for audit only).
//
// Upgrading: rows recorded before isolation was on are under the plain key.
// A principal's retry of such a request, after the upgrade, runs again.
// Deploy with PrincipalShared first and switch to isolation once the
// route's TTL has passed if that matters.
//
// # Consumers and HTTP on one ledger
//
// A route and a consumer that name the same scope share keys (the tenant
// must match too; consumers use ""). A key first processed by a consumer
// answers an HTTP retry with the consumer's recorded result if it recorded
// an HTTP-shaped one, and otherwise with a documented default: 200,
// Content-Type application/json, body {"status":"already_processed",
// "source":"kafka"} (the consumer's source) and the replay header. A key a
// consumer dead-lettered (status failed) answers 422 (key-failed) with the
// replay header: it will not run again under that key. A key first used
// over HTTP is a duplicate to consumers in the scope: consumers record no
// fingerprint, so there is no mismatch between the two paths.
//
// A consumer's event ID is a plain key. Requests of a principal on a route
// that isolates principals (the default when Config.Principal is set) are
// recorded under another ID and do not dedupe with the consumer: a route
// that shares keys with a consumer sets PrincipalKeys to PrincipalShared
// (or its Principal function returns "").
//
// # Lease mode
//
// RouteConfig.Lease runs the handler outside any transaction, for effects
// outside the database (a payment provider): the key is claimed with a
// lease, renewed while the handler runs, and completed afterwards; the
// handler gets FencingToken instead of Tx, and passes Key (or the token)
// to the downstream call so that it can dedupe too. A crash mid-handler lets the
// lease expire and a retry runs the handler again: those effects are
// at-least-once, made safe by the fencing token and an idempotent
// downstream. Replays of lease-mode routes are served by Postgres.
//
// The lease is renewed until its end is recorded. Once the handler's effect
// has happened, a transient failure to record the result (inbox.IsTransient)
// is retried with backoff, for up to Config.HandlerTimeout, so that the
// lease does not lapse and let a retry run the effect again; a completion
// that committed but whose answer was lost is recognised by its fencing
// token. What a lease-mode request gets:
//
//	outcome                                  answer                   ledger
//	kept status, result recorded             the handler's response   stored; retries replay it
//	status not kept (5xx by default)         the handler's response   lease released; key free
//	panic                                    re-raised                lease released; key free
//	response over MaxResponseBytes           500 response-too-large   failed; retries get 422 key-failed
//	lease lost while the handler ran         500 lease-lost           another holder's
//	store unavailable for HandlerTimeout     503 store-unavailable,   processing until the lease expires;
//	  after the handler ended                  Retry-After              then a retry runs again
//
// # Client side
//
// Transport is an http.RoundTripper for Go callers: it adds a UUID v4 key to
// POST and PATCH requests without one and retries 409, 425, 429, 5xx and
// network errors with the same key, with exponential backoff and jitter.
//
// # Other frameworks
//
// Echo: e.POST("/orders", h, echo.WrapMiddleware(bridge.Route(rc))). Gin:
// write the handler as an http.Handler and register
// gin.WrapH(bridge.Route(rc)(h)). The middleware buffers the response
// through its own http.ResponseWriter, so the framework's writer must be
// the one it is given.
package httpbridge
