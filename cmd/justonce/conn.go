package main

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/internal/ledgerkey"
)

// connectTimeout bounds connecting to Postgres when the URL sets no
// connect_timeout, so an unreachable host fails in seconds.
const connectTimeout = 10 * time.Second

// dbFlags are the connection flags every database command takes.
type dbFlags struct {
	url    string
	schema string
}

func addDBFlags(f *flags) *dbFlags {
	d := &dbFlags{}
	f.stringEnv(&d.url, "database-url", "DATABASE_URL",
		"Postgres connection `URL`, e.g. postgres://user:password@host:5432/db")
	f.stringEnv(&d.schema, "schema", "JUSTONCE_SCHEMA",
		"`schema` holding processed_events; empty: the connection's search_path")
	return d
}

// pool connects to Postgres and checks that the server answers.
func (d *dbFlags) pool(ctx context.Context) (*pgxpool.Pool, error) {
	if d.url == "" {
		return nil, usageErrorf("no database: set --database-url or DATABASE_URL")
	}
	cfg, err := pgxpool.ParseConfig(d.url)
	if err != nil {
		// pgx redacts the password in its parse errors.
		return nil, usageErrorf("--database-url: %v", err)
	}
	cfg.MaxConns = 2
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = connectTimeout
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
		if err != nil {
			pool.Close()
		}
	}
	if err != nil {
		where := net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
		return nil, fmt.Errorf("cannot reach Postgres at %s (database %q): %w", where, cfg.ConnConfig.Database, err)
	}
	return pool, nil
}

// ledger connects and returns the ledger on the configured schema, with the
// Redis replay cache when rc names one, and the function that closes them.
func (d *dbFlags) ledger(ctx context.Context, rc *redisFlags) (*inbox.Ledger, func(), error) {
	var redisCfg *inbox.RedisConfig
	if rc != nil && rc.url != "" {
		var err error
		if redisCfg, err = rc.open(ctx); err != nil {
			return nil, nil, err
		}
	}
	closeRedis := func() {
		if redisCfg != nil {
			_ = redisCfg.Client.Close()
		}
	}
	pool, err := d.pool(ctx)
	if err != nil {
		closeRedis()
		return nil, nil, err
	}
	closeAll := func() { pool.Close(); closeRedis() }
	l, err := inbox.New(pool, inbox.Config{Schema: d.schema, MaxKeyLen: cliMaxKeyLen, Redis: redisCfg})
	if err != nil {
		closeAll()
		return nil, nil, err
	}
	return l, closeAll, nil
}

// redisFlags name the Redis replay cache the application uses, so that a
// released key is dropped from it too.
type redisFlags struct {
	url     string
	prefix  string
	cluster bool
	client  redis.UniversalClient // set by open
}

func addRedisFlags(f *flags) *redisFlags {
	r := &redisFlags{}
	f.stringEnv(&r.url, "redis-url", "REDIS_URL",
		"Redis `URL` of the application's replay cache (redis://[:password@]host:6379/0); the released key is dropped from it too")
	f.stringEnv(&r.prefix, "redis-prefix", "JUSTONCE_REDIS_PREFIX",
		"key `prefix` the application sets in inbox.RedisConfig.Prefix; empty: both defaults, \"justonce:\" and \"justonce:<schema>:\"")
	f.BoolVar(&r.cluster, "redis-cluster", false,
		"the Redis URL names a Redis Cluster (redis://host1:6379?addr=host2:6379)")
	return r
}

// open connects to Redis and checks that it answers, so that nothing is
// released in Postgres while the cache cannot be invalidated.
func (r *redisFlags) open(ctx context.Context) (*inbox.RedisConfig, error) {
	var c redis.UniversalClient
	if r.cluster {
		opts, err := redis.ParseClusterURL(r.url)
		if err != nil {
			return nil, usageErrorf("--redis-url: %v", err)
		}
		opts.ContextTimeoutEnabled = true
		c = redis.NewClusterClient(opts)
	} else {
		opts, err := redis.ParseURL(r.url)
		if err != nil {
			return nil, usageErrorf("--redis-url: %v", err)
		}
		opts.ContextTimeoutEnabled = true
		c = redis.NewClient(opts)
	}
	pctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	if err := c.Ping(pctx).Err(); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("cannot reach Redis, nothing was changed: %w", err)
	}
	r.client = c
	return &inbox.RedisConfig{Client: c, Prefix: r.prefix, Timeout: 5 * time.Second}, nil
}

// otherPrefix is the default prefix the ledger does not use, whose
// entries a release drops too, or "" when --redis-prefix names the prefix.
// Which default an application has depends on whether it names its schema
// in inbox.Config.Schema ("justonce:<schema>:") or reaches it through
// search_path ("justonce:"); the tool cannot know, so it drops both. A
// deleted entry is always safe: Postgres answers instead.
func (r *redisFlags) otherPrefix(ctx context.Context, l *inbox.Ledger, schema string) (string, error) {
	if r.prefix != "" || r.client == nil {
		return "", nil
	}
	if schema != "" {
		return "justonce:", nil
	}
	// The ledger uses "justonce:"; the other is named after the schema
	// search_path finds the table in.
	if err := l.Pool().QueryRow(ctx, `SELECT coalesce((SELECT n.nspname FROM pg_class c
		JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass('processed_events')), '')`).Scan(&schema); err != nil {
		return "", fmt.Errorf("finding the ledger's schema: %w", err)
	}
	if schema == "" {
		return "", nil
	}
	return "justonce:" + schema + ":", nil
}

// invalidate deletes k's cached result and lock under prefix, after the
// row changed: the caller's cancellation does not stop it.
func (r *redisFlags) invalidate(ctx context.Context, prefix string, k inbox.Key) error {
	if prefix == "" {
		return nil
	}
	res, lock := ledgerkey.RedisKeys(prefix, k.Scope, k.Tenant, k.ID)
	ctx = context.WithoutCancel(ctx)
	var err error
	for try := range 3 {
		if try > 0 {
			time.Sleep(time.Duration(try) * 50 * time.Millisecond)
		}
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = r.client.Del(cctx, res, lock).Err()
		cancel()
		if err == nil {
			return nil
		}
	}
	return err
}
