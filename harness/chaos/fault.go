package main

// The fault kinds, each one small type of the same shape.

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/harness/testsvc"
)

// A fault is one kind of fault the run injects. inject breaks something,
// or says it cannot be done now (false: the schedule tries it again
// later); heal undoes what inject did and waits until the service answers
// again (a restart, a promotion, a removed toxic). The schedule heals a
// fault before it injects the next, and counts a fault once it was
// injected. A fault records what the summary says of it (down times).
type fault interface {
	name() string
	inject(ctx context.Context) (bool, error)
	heal(ctx context.Context) error
}

// faults returns the fault kinds of the run, by name.
func (e *env) faults() map[string]fault {
	fs := []fault{&consumerKill{e}, &relayKill{e: e}, &redisOutage{e: e}, &pgTerminate{e}, &pgCrash{e: e},
		&kafkaCrash{e: e}, &natsRestart{e: e}, &netFault{e: e}, &release{e}, &pgFailover{e: e}, &redisFailover{e: e},
		&natsLeaderKill{e: e}, &overload{e: e}}
	m := map[string]fault{}
	for _, f := range fs {
		m[f.name()] = f
	}
	return m
}

// catch runs a call of a service with a standby (testsvc), whose failures
// are panics, and returns the failure.
func catch(f func()) error { return testsvc.Catch(f) }

// consumerKill SIGKILLs a worker process at random; its slot restarts it.
type consumerKill struct{ e *env }

func (f *consumerKill) name() string { return fKill }

func (f *consumerKill) inject(context.Context) (bool, error) {
	if len(f.e.slots) == 0 {
		return true, nil
	}
	s := f.e.slots[mrand.N(len(f.e.slots))]
	if !s.kill() {
		return false, nil
	}
	f.e.sum.killsBy[s.transport]++
	return true, nil
}

func (f *consumerKill) heal(context.Context) error { return nil }

// relayKill kills an outbox relay while it has work in hand: every relay
// stalls (SIGSTOP) while A goes on adding messages, then resumes, and one
// of them is SIGKILLed a moment into the backlog (or into the batch it
// was stopped in).
type relayKill struct {
	e    *env
	idle int // kills put off because the outbox was empty
}

func (f *relayKill) name() string { return fRelayKill }

func (f *relayKill) inject(ctx context.Context) (bool, error) {
	e := f.e
	var rs []*slot
	for _, s := range e.slots {
		if relayRole(s.transport) {
			rs = append(rs, s)
		}
	}
	if len(rs) == 0 {
		return true, nil
	}
	for _, s := range rs {
		s.signal(syscall.SIGSTOP)
	}
	_ = consumer.Sleep(ctx, e.o.killEvery)
	for _, s := range rs {
		s.signal(syscall.SIGCONT)
	}
	time.Sleep(time.Duration(mrand.N(100)) * time.Millisecond)
	var waiting int
	if err := e.pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&waiting); err != nil || waiting == 0 {
		if f.idle++; f.idle < 20 {
			return false, nil
		}
	}
	s := rs[mrand.N(len(rs))]
	if !s.kill() {
		return false, nil
	}
	f.idle = 0
	if waiting > 0 {
		e.sum.relayKillsBusy++
		e.sum.relayKillRows += waiting
	}
	e.sum.killsBy[s.transport]++
	return true, nil
}

func (f *relayKill) heal(context.Context) error { return nil }

// redisOutage stops the ledgers' Redis and starts it again: the private
// redis-server, or the Sentinel master (killed and restarted at once,
// within the sentinels' down-after, so that no failover starts).
type redisOutage struct {
	e      *env
	master int
}

func (f *redisOutage) name() string { return fRedis }

func (f *redisOutage) inject(context.Context) (bool, error) {
	if s := f.e.redis.sentinel; s != nil {
		return true, catch(func() { f.master = s.KillMaster() })
	}
	f.e.redis.proc.stop()
	return true, nil
}

func (f *redisOutage) heal(ctx context.Context) error {
	if s := f.e.redis.sentinel; s != nil {
		_ = consumer.Sleep(ctx, min(f.e.o.killEvery, testsvc.SentinelDownAfter/2))
		if err := catch(func() { s.RestartInPlace(f.master); s.WaitSettled(time.Minute) }); err != nil {
			return fmt.Errorf("redis restart: %w", err)
		}
		return nil
	}
	_ = consumer.Sleep(ctx, f.e.o.killEvery)
	if err := f.e.redis.proc.start(); err != nil {
		return fmt.Errorf("redis restart: %w", err)
	}
	return nil
}

// pgTerminate terminates every Postgres connection of the workers and the
// HTTP server (application_name chaos-...).
type pgTerminate struct{ e *env }

func (f *pgTerminate) name() string { return fPgTerminate }

func (f *pgTerminate) inject(ctx context.Context) (bool, error) {
	var n int
	if err := f.e.admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
		WHERE application_name LIKE 'chaos-%' AND pid <> pg_backend_pid()`).Scan(&n); err != nil {
		return false, nil
	}
	f.e.sum.pgTerminated += n
	return true, nil
}

func (f *pgTerminate) heal(context.Context) error { return nil }

// pgCrash SIGKILLs Postgres and restarts it (crash recovery): the
// postmaster of services.sh, or the primary of the replica set, restarted
// in place.
type pgCrash struct {
	e  *env
	t0 time.Time
}

func (f *pgCrash) name() string { return fPgCrash }

func (f *pgCrash) inject(context.Context) (bool, error) {
	fmt.Fprintf(errOut, "chaos: SIGKILL postgres\n")
	f.t0 = time.Now()
	if rs := f.e.pg.rs; rs != nil {
		return true, catch(func() { rs.KillPrimary() })
	}
	return true, f.e.svc.kill("postgres")
}

func (f *pgCrash) heal(ctx context.Context) error {
	var err error
	if rs := f.e.pg.rs; rs != nil {
		err = catch(rs.RestartPrimary)
	} else {
		err = f.e.svc.restart(ctx, "postgres")
	}
	f.e.sum.down[fPgCrash] = append(f.e.sum.down[fPgCrash], time.Since(f.t0))
	f.e.admin.Reset()
	f.e.pool.Reset()
	return err
}

// kafkaCrash SIGKILLs the broker of services.sh and restarts it.
type kafkaCrash struct {
	e  *env
	t0 time.Time
}

func (f *kafkaCrash) name() string { return fKafkaCrash }

func (f *kafkaCrash) inject(context.Context) (bool, error) {
	fmt.Fprintf(errOut, "chaos: SIGKILL kafka\n")
	f.t0 = time.Now()
	return true, f.e.svc.kill("kafka")
}

func (f *kafkaCrash) heal(ctx context.Context) error {
	err := f.e.svc.restart(ctx, "kafka")
	f.e.sum.down[fKafkaCrash] = append(f.e.sum.down[fKafkaCrash], time.Since(f.t0))
	return err
}

// natsRestart restarts NATS on its file store: the embedded server (a
// graceful shutdown, which flushes the store), or, in a cluster, a node
// that leads neither the stream nor its consumer.
type natsRestart struct {
	e    *env
	t0   time.Time
	node int
}

func (f *natsRestart) name() string { return fNatsRestart }

func (f *natsRestart) inject(context.Context) (bool, error) {
	f.t0 = time.Now()
	c := f.e.nats.cluster
	if c == nil {
		f.e.nats.single.shutdown()
		return true, nil
	}
	stream, durable := f.e.natsLeadStream()
	f.node = -1
	for i := 0; i < testsvc.NATSClusterSize; i++ {
		if c.Server(i) != nil && i != c.StreamLeader(stream) && i != c.ConsumerLeader(stream, durable) {
			f.node = i
			break
		}
	}
	if f.node < 0 {
		return false, nil
	}
	return true, catch(func() { c.Kill(f.node) })
}

func (f *natsRestart) heal(ctx context.Context) error {
	var err error
	if c := f.e.nats.cluster; c != nil {
		_ = consumer.Sleep(ctx, f.e.o.killEvery)
		stream, _ := f.e.natsLeadStream()
		err = catch(func() { c.Restart(f.node); c.WaitStreamCurrent(stream, 2*time.Minute) })
	} else {
		time.Sleep(f.e.o.killEvery)
		err = f.e.nats.single.start()
	}
	if err != nil {
		return fmt.Errorf("nats restart: %w", err)
	}
	f.e.sum.down[fNatsRestart] = append(f.e.sum.down[fNatsRestart], time.Since(f.t0))
	return nil
}

// netFault is a network fault episode through the fault proxy: reset-peer,
// latency and timeout in turn (see netFaults.toxics).
type netFault struct {
	e    *env
	turn int
	on   toxicSpec
}

func (f *netFault) name() string { return fNet }

func (f *netFault) inject(context.Context) (bool, error) {
	k := netFaultKinds[f.turn%len(netFaultKinds)]
	f.turn++
	t, err := f.e.nf.toxics(k)
	if err != nil {
		return true, err
	}
	f.on = t
	if err := t.add(); err != nil {
		return true, errors.Join(err, t.remove(context.Background()))
	}
	f.e.sum.netKinds[k]++
	return true, nil
}

func (f *netFault) heal(ctx context.Context) error {
	_ = consumer.Sleep(ctx, f.on.d)
	return f.on.remove(ctx)
}

// release is an operator's repair: see operatorRelease. It cannot be done
// before some permanent failure was recorded.
type release struct{ e *env }

func (f *release) name() string { return fRelease }

func (f *release) inject(ctx context.Context) (bool, error) {
	e := f.e
	n, err := operatorRelease(ctx, e.pool, e.opLedger, e.producers, e.resend, e.released, e.o.hostileEvery, 3)
	e.sum.released += n
	if err != nil {
		e.sum.releaseFailed++
		fmt.Fprintln(errOut, "chaos: release:", err)
	}
	return n > 0, nil
}

func (f *release) heal(context.Context) error { return nil }

// pgFailover SIGKILLs the primary of the replica set and promotes its
// synchronous standby; healing rebuilds the dead node as the new
// standby, so that the next failover finds one. The down time is from
// the kill to the promotion.
type pgFailover struct {
	e  *env
	t0 time.Time
}

func (f *pgFailover) name() string { return fPgFailover }

func (f *pgFailover) inject(context.Context) (bool, error) {
	rs := f.e.pg.rs
	if rs == nil {
		return true, errors.New("no replica set (-pg-failovers 0)")
	}
	f.t0 = time.Now()
	var old int
	err := catch(func() { old = rs.KillPrimary() })
	fmt.Fprintf(errOut, "chaos: Postgres primary (node %d) SIGKILLed\n", old)
	return true, err
}

func (f *pgFailover) heal(context.Context) error {
	rs := f.e.pg.rs
	if err := catch(rs.Promote); err != nil {
		return err
	}
	f.e.sum.down[fPgFailover] = append(f.e.sum.down[fPgFailover], time.Since(f.t0))
	f.e.admin.Reset()
	f.e.pool.Reset()
	if err := catch(rs.RebuildStandby); err != nil {
		return err
	}
	f.e.sum.rebuilt = append(f.e.sum.rebuilt, time.Since(f.t0))
	return nil
}

// redisFailover SIGKILLs the Sentinel master and waits until the
// sentinels promote the replica; healing restarts the dead node, which
// the sentinels make the new master's replica. The down time is from the
// kill to every sentinel naming the new master.
type redisFailover struct {
	e      *env
	t0     time.Time
	master int
}

func (f *redisFailover) name() string { return fRedisFailover }

func (f *redisFailover) inject(context.Context) (bool, error) {
	s := f.e.redis.sentinel
	if s == nil {
		return true, errors.New("no Sentinel (-redis-failovers 0)")
	}
	return true, catch(func() {
		s.WaitSettled(time.Minute)
		f.t0 = time.Now()
		f.master = s.KillMaster()
	})
}

func (f *redisFailover) heal(context.Context) error {
	s := f.e.redis.sentinel
	if err := catch(func() { s.WaitFailover(f.master, time.Minute) }); err != nil {
		return err
	}
	f.e.sum.down[fRedisFailover] = append(f.e.sum.down[fRedisFailover], time.Since(f.t0))
	return catch(func() { s.Restart(f.master); s.WaitSettled(time.Minute) })
}

// natsLeaderKill kills the node leading the stream (the NATS front's, or
// the pipeline's); healing waits until another node leads it, restarts
// the dead node on its file store and waits until every node's copy is
// current. The down time is from the kill to the new leader.
type natsLeaderKill struct {
	e      *env
	t0     time.Time
	leader int
}

func (f *natsLeaderKill) name() string { return fNatsLeader }

func (f *natsLeaderKill) inject(context.Context) (bool, error) {
	c := f.e.nats.cluster
	if c == nil {
		return true, errors.New("no NATS cluster (-nats-leader-kills 0)")
	}
	stream, _ := f.e.natsLeadStream()
	if f.leader = c.StreamLeader(stream); f.leader < 0 {
		return false, nil
	}
	f.t0 = time.Now()
	err := catch(func() { c.Kill(f.leader) })
	fmt.Fprintf(errOut, "chaos: NATS node %d (leading %s) killed\n", f.leader, stream)
	return true, err
}

func (f *natsLeaderKill) heal(ctx context.Context) error {
	c := f.e.nats.cluster
	stream, _ := f.e.natsLeadStream()
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if l := c.StreamLeader(stream); l >= 0 && l != f.leader {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("nats: no new leader of %s 2 minutes after node %d was killed", stream, f.leader)
		}
		if err := consumer.Sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	f.e.sum.down[fNatsLeader] = append(f.e.sum.down[fNatsLeader], time.Since(f.t0))
	return catch(func() { c.Restart(f.leader); c.WaitStreamCurrent(stream, 2*time.Minute) })
}

// natsLeadStream is the stream the NATS faults aim at, and its durable:
// the NATS front's, else the kafka>nats pipeline's.
func (e *env) natsLeadStream() (stream, durable string) {
	if e.want["nats"] {
		return "CHAOS", "chaos"
	}
	return hopStream, "chaos-hop"
}

// overload makes the ledger's Postgres the bottleneck: a transaction takes
// a SHARE lock on the effects table (reads go on, every handler's INSERT
// waits), and holds it for -overload-for. Every handler then holds its
// transaction and its connection: the workers' pools fill, the HTTP and
// gRPC bridges shed what waits longer than their AcquireWait (503
// overloaded, Unavailable OVERLOADED; the clients retry with the same
// key), the consumers stall with their fetches paused. Heal releases the
// lock and everything drains: each event and key must still have exactly
// one effect.
type overload struct {
	e  *env
	tx pgx.Tx
	t0 time.Time
}

func (f *overload) name() string { return fOverload }

func (f *overload) inject(ctx context.Context) (bool, error) {
	tx, err := f.e.pool.Begin(ctx)
	if err != nil {
		return false, nil
	}
	// A lock that does not come at once (a failover under way) is tried
	// later.
	_, err = tx.Exec(ctx, `SET LOCAL lock_timeout = '5s'`)
	if err == nil {
		_, err = tx.Exec(ctx, `LOCK TABLE effects IN SHARE MODE`)
	}
	if err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return false, nil
	}
	fmt.Fprintf(errOut, "chaos: overload: effects locked for %s\n", f.e.o.overloadFor)
	f.tx, f.t0 = tx, time.Now()
	return true, nil
}

func (f *overload) heal(ctx context.Context) error {
	t := time.NewTimer(f.e.o.overloadFor)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := f.tx.Rollback(rctx)
	f.e.sum.down[fOverload] = append(f.e.sum.down[fOverload], time.Since(f.t0))
	if err != nil && !errors.Is(err, pgx.ErrTxClosed) {
		// The lock's connection died (a Postgres fault): the lock went with it.
		fmt.Fprintf(errOut, "chaos: overload: release: %v\n", err)
	}
	return nil
}
