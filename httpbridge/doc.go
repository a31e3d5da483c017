// Package httpbridge gives net/http endpoints the behaviour of the IETF
// Idempotency-Key header field, on the same processed_events ledger
// (package inbox) the Kafka and NATS consumers use: an API request and an
// event with the same key in the same scope run once between them.
//
// Make a Bridge on a ledger and wrap each route with Bridge.Route; the
// middleware is a func(http.Handler) http.Handler, so the standard mux,
// chi and gorilla take it as is (see the package example). The handler
// writes through Tx, the ledger's transaction: its writes, the ledger row
// and the buffered response commit together, and the client gets the
// response only after the commit. The bridge logs through the ledger's
// logger (inbox.Config.Logger), with keys masked.
//
// What a covered request (POST and PATCH by default) gets:
//
//   - first request with a key: the handler's response;
//   - same key, same request, completed: the stored status, headers and
//     body, byte for byte, with Idempotent-Replayed: true;
//   - same key while the first still runs: 409 with Retry-After, or the
//     replay after up to RouteConfig.LockWait;
//   - same key, another request (method, path, query, canonical body,
//     RouteConfig.FingerprintHeaders): 422, whose "differences" member
//     names what differs ("body:/amount", "header:Api-Version"), never the
//     values; or a new request with MismatchNewRequest;
//   - a malformed key, or one RouteConfig.KeyValidator refuses: 400; no
//     key: the handler runs in a plain transaction, or 400 when
//     RouteConfig.Required;
//   - a new key over the tenant's RouteConfig.KeyRate: 429 with
//     Retry-After, nothing recorded;
//   - the handler answered success but its transaction did not commit:
//     500 not-committed, nothing stored, the key free;
//   - database unreachable: 503 with Retry-After; nothing recorded;
//   - database overloaded (no pool connection within Config.AcquireWait):
//     503 overloaded with Retry-After; the request did not run, nothing
//     recorded.
//
// Every answer about a recorded key says when the key expires
// (Idempotency-Key-Expires, an HTTP-date; Config.ExpiresHeader): past it,
// the same key runs as a new request, so package httpretry stops retrying
// a key there. Answers the bridge gives itself are
// application/problem+json (RFC 9457) with the stable types of the
// Problem constants. Refused keys (missing on a required route, invalid)
// are logged at WARN and replays at INFO, with the client's address and
// user agent, keys masked.
//
// RouteConfig.Observe rolls a route out without risk: every request runs
// as if the bridge were absent, while the ledger records keys and
// fingerprints so that the log and Config.OnObserve (a metric of package
// metrics) say what enforcing would have done.
//
// RouteConfig.Store decides which statuses are kept (DefaultStore: 2xx to
// 4xx but 408, 409, 425 and 429). Any other status, a panic and a response
// over RouteConfig.MaxResponseBytes roll the transaction back: the key
// stays free and a retry runs again. Credentials (Set-Cookie,
// Authorization, ...) are never stored nor replayed; Config.Encryption
// encrypts stored bodies at rest. A keyed handler runs on a context that
// does not end when the client goes away (bounded by
// Config.HandlerTimeout), so that the client's retry gets the replay.
//
// With Config.Principal set, keys are isolated per principal
// (RouteConfig.PrincipalKeys: inbox.PrincipalIsolated, the default): a key
// replays only to the principal that sent it, and another principal's
// request with the same key runs on its own and learns nothing of the
// first. Such routes take keys of at most 231 bytes, on every request.
// RouteConfig.MaxLiveKeys caps a tenant's live keys (429).
//
// RouteConfig.Lease runs the handler outside any transaction, under a
// lease, for effects outside the database: the handler gets FencingToken
// instead of Tx and passes Key or the token downstream. A crash
// mid-handler lets the lease expire and a retry runs it again, so such
// effects are at-least-once, made safe by an idempotent downstream.
// RouteConfig.Steps runs it in steps instead (inbox.Ledger.DoSteps): the
// handler records its work as steps through Steps(ctx), and a retry with
// the key resumes after the steps recorded; FailSteps fails the key for
// good after the declared compensations.
//
// A route and a consumer naming the same scope share keys: a key a
// consumer processed answers an HTTP retry with the consumer's recorded
// result, or 200 {"status":"already_processed","source":"kafka"}; a key a
// consumer dead-lettered answers 422 key-failed.
//
// Package httpretry is the client side: an http.RoundTripper that adds a
// key and retries with it. The full rules, limits and failure tables are
// in the handbook: https://github.com/justonce/justonce/blob/main/docs/http.md
package httpbridge
