package inbox

import (
	"context"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ownedTx is the pgx.Tx a handler gets in Do: the transaction the ledger
// opened (BEGIN pipelined with the claim, so it costs no extra round trip).
// Queries go straight to the connection. Commit and Rollback belong to the
// ledger and return ErrTxOwned; Begin opens a savepoint as pgx does.
// LargeObjects is not supported on it.
type ownedTx struct {
	conn *pgx.Conn
	sp   int
}

var _ pgx.Tx = (*ownedTx)(nil)

func (t *ownedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	return beginSavepoint(ctx, t.conn, &t.sp)
}
func (t *ownedTx) Commit(context.Context) error   { return ErrTxOwned }
func (t *ownedTx) Rollback(context.Context) error { return ErrTxOwned }
func (t *ownedTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }
func (t *ownedTx) Conn() *pgx.Conn                { return t.conn }

func (t *ownedTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return t.conn.CopyFrom(ctx, table, cols, src)
}
func (t *ownedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.conn.SendBatch(ctx, b)
}
func (t *ownedTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.conn.Prepare(ctx, name, sql)
}
func (t *ownedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.conn.Exec(ctx, sql, args...)
}
func (t *ownedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.conn.Query(ctx, sql, args...)
}
func (t *ownedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.conn.QueryRow(ctx, sql, args...)
}

// savepointTx is a nested transaction inside an ownedTx.
type savepointTx struct {
	ownedTx
	name   string
	closed bool
}

func beginSavepoint(ctx context.Context, conn *pgx.Conn, counter *int) (pgx.Tx, error) {
	*counter++
	name := "justonce_sp_" + strconv.Itoa(*counter)
	if _, err := conn.Exec(ctx, sqlSavepoint(name)); err != nil {
		return nil, err
	}
	return &savepointTx{ownedTx: ownedTx{conn: conn, sp: *counter}, name: name}, nil
}

func (t *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if t.closed {
		return nil, pgx.ErrTxClosed
	}
	return beginSavepoint(ctx, t.conn, &t.sp)
}

func (t *savepointTx) Commit(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	t.closed = true
	_, err := t.conn.Exec(ctx, sqlReleaseSavepoint(t.name))
	return err
}

func (t *savepointTx) Rollback(ctx context.Context) error {
	if t.closed {
		return pgx.ErrTxClosed
	}
	t.closed = true
	_, err := t.conn.Exec(ctx, sqlRollbackToSavepoint(t.name))
	return err
}
