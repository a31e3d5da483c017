package grpcbridge

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/bridgereq"
)

// Source is what the ledger records as the source of the calls the bridge
// runs.
const Source inbox.Source = "grpc"

// Bridge gives unary gRPC methods idempotency keys on an inbox.Ledger.
// Make one per ledger with New and install UnaryServerInterceptor. Safe
// for concurrent use.
type Bridge struct {
	cfg          Config
	log          *slog.Logger
	methods      map[string]*method
	metadataKey  string
	firstSentKey string
	replayHeader string
	expiresKey   string
}

// New returns a Bridge for cfg, or an error matching inbox.ErrConfig.
func New(cfg Config) (*Bridge, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.RetryAfter == 0 {
		cfg.RetryAfter = DefaultRetryAfter
	}
	if cfg.HandlerTimeout == 0 {
		cfg.HandlerTimeout = DefaultHandlerTimeout
	}
	if cfg.AcquireWait == 0 {
		cfg.AcquireWait = DefaultAcquireWait
	}
	if cfg.ClockSkew == 0 {
		cfg.ClockSkew = DefaultClockSkew
	}
	cfg.MinTTL = or(cfg.MinTTL, DefaultMinTTL)
	b := &Bridge{
		cfg: cfg, log: cfg.Ledger.Logger(), methods: map[string]*method{},
		metadataKey: or(cfg.MetadataKey, DefaultMetadataKey), firstSentKey: or(cfg.FirstSentKey, DefaultFirstSentKey),
		replayHeader: or(cfg.ReplayHeader, DefaultReplayHeader), expiresKey: or(cfg.ExpiresKey, DefaultExpiresKey),
	}
	for name, mc := range cfg.Methods {
		ttl := or(mc.TTL, cfg.Ledger.DefaultTTL())
		switch {
		case mc.Off:
		case ttl <= 2*cfg.ClockSkew:
			return nil, configErr("method %s: TTL %s must be over twice ClockSkew (%s)", name, ttl, cfg.ClockSkew)
		case ttl < cfg.MinTTL && !mc.AllowShortTTL:
			return nil, configErr("method %s: TTL %s is under MinTTL %s (AEP-155's minimum lifetime); set AllowShortTTL if clients retry within it",
				name, ttl, cfg.MinTTL)
		}
		m := newMethod(mc, &cfg)
		m.ttl = ttl
		b.methods[name] = m
	}
	return b, nil
}

func or[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// lookup finds a method's policy: its exact name, else its service's.
func (b *Bridge) lookup(full string) *method {
	if m, ok := b.methods[full]; ok {
		return m
	}
	if i := strings.LastIndexByte(full, '/'); i > 0 {
		return b.methods[full[:i+1]+"*"]
	}
	return nil
}

// UnaryServerInterceptor returns the server interceptor:
//
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(recovery, bridge.UnaryServerInterceptor()))
//
// Put it after authentication (Config.Tenant and Config.Principal read
// what that put in the context) and inside a recovery interceptor: a
// handler's panic rolls back and is re-raised.
func (b *Bridge) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		m := b.lookup(info.FullMethod)
		if m == nil || m.Off {
			return handler(ctx, req)
		}
		if m.Observe {
			return b.observe(ctx, req, info.FullMethod, m, handler)
		}
		return b.serve(ctx, req, info.FullMethod, m, handler)
	}
}

// Sentinels a TxFunc returns to roll back while the interceptor still
// answers.
var (
	errNotStored = errors.New("grpcbridge: status not stored")
	errPanicked  = errors.New("grpcbridge: handler panicked")
	errEncode    = errors.New("grpcbridge: answer cannot be stored")
)

type panicked struct {
	value any
	stack []byte
}

func (b *Bridge) serve(ctx context.Context, req any, full string, m *method, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx) // a copy: read it once
	ck, present, err := b.readKey(req, md, m)
	var kp *keyProblem
	var nf errNoField
	switch {
	case errors.As(err, &kp):
		b.log.WarnContext(ctx, "justonce/grpcbridge: invalid key",
			b.attrs(ctx, md, "method", full, "reason", kp.msg, "key", inbox.Mask(ck.raw))...)
		return nil, invalidKey(kp)
	case errors.As(err, &nf):
		b.log.ErrorContext(ctx, "justonce/grpcbridge: method misconfigured", "method", full, "err", err)
		return nil, status.Error(codes.Internal, "the server cannot read this method's idempotency key")
	case !present && m.Required:
		b.log.WarnContext(ctx, "justonce/grpcbridge: missing key", b.attrs(ctx, md, "method", full)...)
		return nil, invalidKey(b.missingKey(m))
	case !present:
		return b.serveKeyless(ctx, req, full, m, handler)
	}
	if p := b.checkFirstSent(ck, m); p != nil {
		b.log.WarnContext(ctx, "justonce/grpcbridge: first_sent refused",
			b.attrs(ctx, md, "method", full, "reason", p.msg, "key", inbox.Mask(ck.key))...)
		return nil, invalidKey(p)
	}

	fp, err := b.callFingerprint(full, req, m, md)
	if err != nil {
		b.log.ErrorContext(ctx, "justonce/grpcbridge: fingerprint", "method", full, "err", err)
		return nil, status.Error(codes.Internal, "the request cannot be fingerprinted")
	}
	r, err := m.spec.Request(b.cfg.Ledger, ck.key, fp, bridgereq.Call(b.cfg.Tenant, ctx), bridgereq.Call(b.cfg.Principal, ctx))
	if err != nil {
		var ke *bridgereq.KeyError
		if errors.As(err, &ke) {
			b.log.WarnContext(ctx, "justonce/grpcbridge: invalid key",
				b.attrs(ctx, md, "method", full, "reason", ke.Error(), "key", inbox.Mask(ck.key))...)
			return nil, invalidKey(&keyProblem{reasonInvalid, ck.keyField, ke.Error()})
		}
		b.log.ErrorContext(ctx, "justonce/grpcbridge: key rejected by the ledger", "key", r.Key.String(), "err", err)
		return nil, status.Error(codes.Internal, "the call's key is rejected by the ledger")
	}

	// The work a client started is finished and recorded even if the
	// client goes away or its deadline passes: its retry gets the replay.
	hctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), b.cfg.HandlerTimeout)
	defer cancel()
	hctx = bridgereq.WithKey(hctx, ck.key)
	bs := &bufferedStream{method: full}
	hctx = grpc.NewContextWithServerTransportStream(hctx, bs)

	if m.Steps {
		return b.serveSteps(ctx, hctx, md, r, ck, m, req, handler, bs)
	}
	var resp any
	var herr error
	var pv *panicked
	out, err := m.spec.Do(hctx, b.cfg.Ledger, &r, func(ctx context.Context, tx pgx.Tx) (inbox.Result, error) {
		resp, pv, herr = run(bridgereq.WithTx(ctx, tx), req, handler)
		switch {
		case pv != nil:
			return inbox.Result{}, errPanicked
		case !m.Store(status.Code(herr)) && isPlain(herr):
			// The ledger tells a failure of the store (its connection
			// died) from the handler's own (returned as is).
			return inbox.Result{}, herr
		case !m.Store(status.Code(herr)):
			return inbox.Result{}, errNotStored
		}
		hdr, trl := bs.metadata()
		res, err := encodeResult(resp, herr, b.stored(hdr), b.stored(trl), ck.firstSent)
		if err != nil {
			return inbox.Result{}, fmt.Errorf("%w: %w", errEncode, err)
		}
		return res, nil
	})
	var kre *inbox.KeyRateError
	errors.As(err, &kre)
	switch {
	case pv != nil:
		b.log.ErrorContext(ctx, "justonce/grpcbridge: handler panicked; rolled back, key released",
			"key", r.Key.String(), "panic", fmt.Sprint(pv.value), "stack", string(pv.stack))
		panic(pv.value)
	case kre != nil:
		b.log.InfoContext(ctx, "justonce/grpcbridge: new-key rate limit reached",
			b.attrs(ctx, md, "key", r.Key.String(), "limit", kre.Limit, "window", kre.Window.String())...)
		return nil, withDetails(codes.ResourceExhausted,
			fmt.Sprintf("this tenant started %d new keys here in the current window of %s, the limit; nothing was recorded, "+
				"call again with the same key after the RetryInfo delay", kre.Limit, kre.Window),
			errorInfo(reasonKeyRate, nil), &errdetails.RetryInfo{RetryDelay: durationpb.New(kre.RetryAfter)})
	case err != nil && isPlain(herr) && errors.Is(err, herr) && !inbox.IsTransient(err):
		b.log.DebugContext(ctx, "justonce/grpcbridge: handler failed, rolled back", "key", r.Key.String(), "err", herr)
		b.flush(ctx, bs)
		return resp, herr
	case errors.Is(err, errNotStored):
		b.log.DebugContext(ctx, "justonce/grpcbridge: status not stored, rolled back", "key", r.Key.String(), "code", status.Code(herr).String())
		b.flush(ctx, bs)
		return resp, herr
	case errors.Is(err, errEncode):
		b.log.ErrorContext(ctx, "justonce/grpcbridge: answer not storable; rolled back", "key", r.Key.String(), "err", err)
		return nil, status.Error(codes.Internal, "the answer cannot be stored; nothing was done")
	case err != nil:
		return nil, b.failure(r, err)
	}
	return b.done(ctx, md, req, r, ck, m, out, bs, resp, herr)
}

// done answers a call the ledger answered: the handler's answer when it
// ran now (Executed), the stored one or the ledger's otherwise.
func (b *Bridge) done(ctx context.Context, md metadata.MD, req any, r inbox.Request, ck callKey, m *method, out inbox.Outcome, bs *bufferedStream, resp any, herr error) (any, error) {
	if exp, ok := bridgereq.Expiry(out, time.Now(), m.ttl, b.cfg.HandlerTimeout); ok {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(b.expiresKey, exp.UTC().Truncate(time.Second).Format(time.RFC3339)))
	}
	if out.Disposition == inbox.Executed {
		b.flush(ctx, bs)
		return resp, herr
	}
	if rec := out.Record; out.Disposition == inbox.Duplicate && rec != nil && rec.ResultGone && rec.Status == inbox.StatusDone {
		return b.stale(ctx, md, req, m, r, ck, rec)
	}
	return b.answer(ctx, md, r, ck, out)
}

// readKey reads the call's key, where the method says, and applies its
// KeyValidator.
func (b *Bridge) readKey(req any, md metadata.MD, m *method) (ck callKey, present bool, err error) {
	if m.Key == KeyFromMessage {
		ck, present, err = keyFromMessage(req, m)
	} else {
		ck, present, err = b.keyFromMetadata(md, m)
	}
	if err == nil && present && m.KeyValidator != nil {
		if verr := m.KeyValidator(ck.key); verr != nil {
			msg := verr.Error()
			if msg == "" {
				msg = "the key is not of the form this method requires"
			}
			return ck, false, &keyProblem{reasonInvalid, ck.keyField, msg}
		}
	}
	return ck, present, err
}

// missingKey is the problem of a call without a key on a Required
// method.
func (b *Bridge) missingKey(m *method) *keyProblem {
	field := b.metadataKey + " metadata"
	if m.Key == KeyFromMessage {
		field = m.Field + ".key"
	}
	return &keyProblem{reasonMissing, field, "this method requires an idempotency key (" + field + "), unique per operation"}
}

// checkFirstSent applies RequireFirstSent and AEP-155's first_sent rules.
func (b *Bridge) checkFirstSent(ck callKey, m *method) *keyProblem {
	if ck.firstSent.IsZero() {
		if m.RequireFirstSent {
			return &keyProblem{reasonFSMissing, ck.fsField, "this method requires first_sent (" + ck.fsField + ") with the key"}
		}
		return nil
	}
	return checkFirstSent(ck.firstSent, time.Now(), m.ttl, b.cfg.ClockSkew, ck.fsField)
}

// attrs are a log line's attributes followed by the peer's address and
// user agent.
func (b *Bridge) attrs(ctx context.Context, md metadata.MD, kv ...any) []any {
	addr := ""
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		addr = p.Addr.String()
	}
	ua := ""
	if v := md.Get("user-agent"); len(v) > 0 {
		ua = v[0]
	}
	return append(kv, bridgereq.Client(addr, ua)...)
}

// isPlain reports a handler's error that is not a gRPC status.
func isPlain(herr error) bool {
	if herr == nil {
		return false
	}
	_, ok := status.FromError(herr)
	return !ok
}

// run calls the handler and catches its panic.
func run(ctx context.Context, req any, handler grpc.UnaryHandler) (resp any, p *panicked, err error) {
	defer func() {
		if v := recover(); v != nil {
			p = &panicked{value: v, stack: debug.Stack()}
		}
	}()
	resp, err = handler(ctx, req)
	return resp, nil, err
}

// flush sends the metadata the handler set, now that the outcome is known.
func (b *Bridge) flush(ctx context.Context, bs *bufferedStream) {
	hdr, trl := bs.metadata()
	if len(hdr) > 0 {
		_ = grpc.SetHeader(ctx, hdr)
	}
	if len(trl) > 0 {
		_ = grpc.SetTrailer(ctx, trl)
	}
}

// answer handles an Outcome whose handler did not run now.
func (b *Bridge) answer(ctx context.Context, md metadata.MD, r inbox.Request, ck callKey, out inbox.Outcome) (any, error) {
	rec := out.Record
	source := ""
	if rec != nil {
		source = string(rec.Source)
	}
	switch out.Disposition {
	case inbox.InFlight:
		b.log.InfoContext(ctx, "justonce/grpcbridge: in flight", b.attrs(ctx, md, "key", r.Key.String())...)
		return nil, b.retryable(codes.Aborted, reasonInProgress,
			"a call with this key is being processed; retry after the RetryInfo delay with the same key")
	case inbox.Mismatch:
		if rec != nil && rec.Source != Source {
			// Another front holds or ran the key; its fingerprint is of
			// another kind: answered as for that front's key, in flight,
			// failed or done.
			if rec.Status == inbox.StatusProcessing {
				return b.answer(ctx, md, r, ck, inbox.Outcome{Disposition: inbox.InFlight, Record: rec})
			}
			return b.answer(ctx, md, r, ck, inbox.Outcome{Disposition: inbox.Duplicate, Record: rec, Result: rec.Result})
		}
		diff := bridgereq.Differences(out, r.Fingerprint)
		b.log.InfoContext(ctx, "justonce/grpcbridge: key reused with another request",
			b.attrs(ctx, md, "key", r.Key.String(), "differences", diff)...)
		return nil, reused(ck, diff)
	case inbox.Duplicate:
		if rec != nil && rec.Status == inbox.StatusFailed {
			b.log.InfoContext(ctx, "justonce/grpcbridge: replay of a failed key", b.attrs(ctx, md, "key", r.Key.String(), "source", source)...)
			_ = grpc.SetHeader(ctx, metadata.Pairs(b.replayHeader, "true"))
			return nil, withDetails(codes.FailedPrecondition,
				fmt.Sprintf("the operation for this key failed for good (recorded by %s) and will not run again under this key; send a new key", sourceName(source)),
				errorInfo(reasonFailed, map[string]string{"source": source}))
		}
		a, ok := decodeResult(out.Result)
		if !ok {
			return b.elsewhere(ctx, md, r, source)
		}
		if !a.firstSent.IsZero() && !ck.firstSent.IsZero() && !a.firstSent.Equal(ck.firstSent) {
			return nil, invalidKey(&keyProblem{reasonChanged, ck.fsField, fmt.Sprintf(
				"first_sent %s differs from the %s this key was first sent with",
				ck.firstSent.Format(time.RFC3339Nano), a.firstSent.Format(time.RFC3339Nano))})
		}
		hdr := a.header.Copy()
		hdr.Set(b.replayHeader, "true")
		_ = grpc.SetHeader(ctx, hdr)
		if len(a.trailer) > 0 {
			_ = grpc.SetTrailer(ctx, a.trailer)
		}
		b.log.InfoContext(ctx, "justonce/grpcbridge: replay",
			b.attrs(ctx, md, "key", r.Key.String(), "code", a.code.String(), "cached", out.Cached)...)
		return a.answer()
	}
	b.log.ErrorContext(ctx, "justonce/grpcbridge: unexpected ledger outcome", "key", r.Key.String(), "disposition", out.Disposition.String())
	return nil, status.Error(codes.Internal, "unexpected ledger outcome")
}

// deniedMetadata are the metadata keys never stored nor replayed.
var deniedMetadata = []string{"authorization", "proxy-authorization", "cookie", "set-cookie"}

// stored is md without the keys that are never stored (deniedMetadata,
// Config.DenyMetadata).
func (b *Bridge) stored(md metadata.MD) metadata.MD {
	for _, k := range deniedMetadata {
		delete(md, k)
	}
	for _, k := range b.cfg.DenyMetadata {
		delete(md, strings.ToLower(k))
	}
	return md
}

// elsewhere answers a key another front (a consumer, the HTTP bridge) ran:
// it does not run again, and there is no gRPC response to replay.
func (b *Bridge) elsewhere(ctx context.Context, md metadata.MD, r inbox.Request, source string) (any, error) {
	b.log.InfoContext(ctx, "justonce/grpcbridge: replay of a key processed by another path", b.attrs(ctx, md, "key", r.Key.String(), "source", source)...)
	_ = grpc.SetHeader(ctx, metadata.Pairs(b.replayHeader, "true"))
	return nil, withDetails(codes.AlreadyExists,
		fmt.Sprintf("the operation for this key was already processed by %s; it does not run again", sourceName(source)),
		errorInfo(reasonElsewhere, map[string]string{"source": source}))
}

func sourceName(s string) string {
	if s == "" {
		return "an earlier attempt"
	}
	return "the " + s + " path"
}

// failure answers a ledger or database error (a call shed for want of a
// connection within Config.AcquireWait: Unavailable, OVERLOADED), or a
// handler's transaction that did not commit.
func (b *Bridge) failure(r inbox.Request, err error) error {
	if errors.Is(err, inbox.ErrOverloaded) {
		// Debug: under overload a line per shed call would be a log
		// storm; justonce_ledger_overloaded_total counts them.
		b.log.Debug("justonce/grpcbridge: overloaded, call shed", "key", r.Key.String(), "err", err)
		return b.retryable(codes.Unavailable, reasonOverloaded,
			"the server is overloaded; no database connection came free in time, so the call did not run and nothing was "+
				"recorded; call again with the same key after the RetryInfo delay")
	}
	if inbox.IsTransient(err) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		b.log.Warn("justonce/grpcbridge: store unavailable", "key", r.Key.String(), "err", err)
		return b.retryable(codes.Unavailable, reasonStoreDown,
			"the idempotency store is unavailable; retry with the same key (it runs again only if it was not recorded)")
	}
	var se *inbox.StoreError
	if errors.Is(err, inbox.ErrRolledBack) || errors.Is(err, pgx.ErrTxCommitRollback) || (errors.As(err, &se) && se.Op == "commit") {
		b.log.Error("justonce/grpcbridge: the handler's transaction did not commit; nothing stored, key released", "key", r.Key.String(), "err", err)
		return withDetails(codes.Internal,
			"the handler's transaction did not commit; nothing was done or stored, and a retry with the same key runs the operation again",
			errorInfo(reasonNotCommit, nil))
	}
	b.log.Error("justonce/grpcbridge: call failed", "key", r.Key.String(), "err", err)
	return status.Error(codes.Internal, "the call failed; nothing was stored")
}

// keylessTx is a plain transaction handed to the handler of a call without
// a key; like the ledger's, it is the interceptor's to end.
type keylessTx struct{ pgx.Tx }

func (keylessTx) Commit(context.Context) error   { return inbox.ErrTxOwned }
func (keylessTx) Rollback(context.Context) error { return inbox.ErrTxOwned }

// serveKeyless runs a call without a key on an optional method: no dedupe,
// but in a transaction, so that the handler has one code path.
func (b *Bridge) serveKeyless(ctx context.Context, req any, full string, m *method, handler grpc.UnaryHandler) (any, error) {
	if m.Steps {
		return handler(ctx, req) // no key, no steps: Steps returns nil
	}
	r := inbox.Request{Key: inbox.Key{Scope: m.Scope}}
	tx, err := bridgereq.Begin(ctx, b.cfg.Ledger.Pool(), b.cfg.AcquireWait)
	if err != nil {
		return nil, b.failure(r, &inbox.StoreError{Op: "begin", Err: err})
	}
	rollback := func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_ = tx.Rollback(rctx)
		cancel()
	}
	bs := &bufferedStream{method: full}
	hctx := grpc.NewContextWithServerTransportStream(bridgereq.WithTx(ctx, keylessTx{tx}), bs)
	resp, pv, herr := run(hctx, req, handler)
	switch {
	case pv != nil:
		rollback()
		b.log.ErrorContext(ctx, "justonce/grpcbridge: handler panicked; rolled back", "method", full, "panic", fmt.Sprint(pv.value))
		panic(pv.value)
	case !m.Store(status.Code(herr)):
		closed := tx.Conn().IsClosed()
		rollback()
		if isPlain(herr) && (closed || inbox.IsTransient(herr)) {
			// The handler's statement met the store's failure.
			return nil, b.failure(r, &inbox.StoreError{Op: "handler", Err: herr})
		}
	default:
		if err := tx.Commit(ctx); err != nil {
			rollback()
			return nil, b.failure(r, &inbox.StoreError{Op: "commit", Err: err})
		}
	}
	b.flush(ctx, bs)
	return resp, herr
}
