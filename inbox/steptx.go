package inbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// stepTx is the pgx.Tx a Postgres step's function gets (Steps.Tx): the
// ledger's transaction, begun by its first statement: BEGIN travels in that
// statement's round trip, and the step's record with COMMIT, so the step
// adds no round trip to its function's own. A statement without arguments
// (sent with the simple protocol, which may hold several), one with an
// explicit QueryExecMode, a copy, a prepare and a savepoint begin the
// transaction first, in a round trip of its own.
type stepTx struct {
	ownedTx
	started bool
}

var _ pgx.Tx = (*stepTx)(nil)

// begun reports whether the transaction has begun (runHandlerTx).
func (t *stepTx) begun() bool { return t.started }

// pipelines reports whether a statement with args can travel in a batch
// behind BEGIN.
func pipelines(args []any) bool {
	if len(args) == 0 {
		return false
	}
	_, mode := args[0].(pgx.QueryExecMode)
	return !mode
}

// begin sends BEGIN alone, if the transaction has not begun.
func (t *stepTx) begin(ctx context.Context) error {
	if t.started {
		return nil
	}
	_, err := t.conn.Exec(ctx, sqlBegin)
	t.started = t.conn.PgConn().TxStatus() != 'I'
	return err
}

// send sends BEGIN and the statement in one batch, and returns its results
// with BEGIN's read. ok is false when BEGIN did not run (the statement
// could not be prepared, or nothing could be sent): the caller then sends
// the statement as usual, after BEGIN alone, so that it fails inside the
// transaction as it would in one begun earlier (it did not run: sending it
// again repeats nothing).
func (t *stepTx) send(ctx context.Context, sql string, args []any) (br pgx.BatchResults, ok bool) {
	b := &pgx.Batch{}
	b.Queue(sqlBegin)
	b.Queue(sql, args...)
	br = t.conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		_ = br.Close()
		return nil, false
	}
	t.started = true
	return br, true
}

func (t *stepTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if !t.started && pipelines(args) {
		if br, ok := t.send(ctx, sql, args); ok {
			tag, err := br.Exec()
			if cerr := br.Close(); err == nil {
				err = cerr
			}
			return tag, err
		}
	}
	if err := t.begin(ctx); err != nil {
		return pgconn.CommandTag{}, err
	}
	return t.conn.Exec(ctx, sql, args...)
}

func (t *stepTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if !t.started && pipelines(args) {
		if br, ok := t.send(ctx, sql, args); ok {
			rows, err := br.Query()
			return &batchRows{Rows: rows, br: br}, err
		}
	}
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return t.conn.Query(ctx, sql, args...)
}

func (t *stepTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if !t.started && pipelines(args) {
		if br, ok := t.send(ctx, sql, args); ok {
			return &batchRow{row: br.QueryRow(), br: br}
		}
	}
	if err := t.begin(ctx); err != nil {
		return errRow{err}
	}
	return t.conn.QueryRow(ctx, sql, args...)
}

// SendBatch sends BEGIN as the batch's first statement (or, when BEGIN
// did not run, alone before the batch, as send does).
func (t *stepTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if !t.started {
		nb := &pgx.Batch{}
		nb.Queue(sqlBegin)
		nb.QueuedQueries = append(nb.QueuedQueries, b.QueuedQueries...)
		br := t.conn.SendBatch(ctx, nb)
		if _, err := br.Exec(); err == nil {
			t.started = true
			return br
		}
		_ = br.Close()
		if err := t.begin(ctx); err != nil {
			return errBatch{err}
		}
	}
	return t.conn.SendBatch(ctx, b)
}

func (t *stepTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	if err := t.begin(ctx); err != nil {
		return 0, err
	}
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *stepTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return t.conn.Prepare(ctx, name, sql)
}

func (t *stepTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return t.ownedTx.Begin(ctx)
}

// batchRows are a query's rows read from a batch, which closes with them.
type batchRows struct {
	pgx.Rows
	br     pgx.BatchResults
	closed bool
}

func (r *batchRows) Next() bool {
	if r.Rows.Next() {
		return true
	}
	r.Close()
	return false
}

func (r *batchRows) Close() {
	r.Rows.Close()
	if !r.closed {
		r.closed = true
		_ = r.br.Close()
	}
}

// batchRow is a query's row read from a batch, which closes with it.
type batchRow struct {
	row pgx.Row
	br  pgx.BatchResults
}

func (r *batchRow) Scan(dest ...any) error {
	err := r.row.Scan(dest...)
	if cerr := r.br.Close(); err == nil {
		err = cerr
	}
	return err
}

// errRow is a row that failed before it was read.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// errBatch is a batch that failed before it was sent.
type errBatch struct{ err error }

func (b errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, b.err }
func (b errBatch) Query() (pgx.Rows, error)         { return nil, b.err }
func (b errBatch) QueryRow() pgx.Row                { return errRow(b) }
func (b errBatch) Close() error                     { return b.err }
func (b errBatch) Tx() pgx.Tx                       { return nil }
