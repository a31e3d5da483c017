package inbox

import (
	"context"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// guardedTx is the pgx.Tx the handlers of an optimistic DoEach run get
// (optimistic_batch.go): the run's transaction, which refuses, with
// ErrTxOwned and without sending it, a statement that would end it
// (COMMIT, END, ROLLBACK but ROLLBACK TO, ABORT, PREPARE TRANSACTION), in
// itself and in the savepoints opened from it. On that path the ledger
// rows of the handlers that ran before are written with the ledger's own
// COMMIT: a handler's COMMIT would make their writes durable without
// their rows, and they would run again. (On the savepoint path each key's
// row is written by its claim, so a handler's COMMIT takes the earlier
// rows with their writes.) A statement that ends the transaction from
// anywhere else (tx.Conn(), a string of several statements) is not
// caught here; the run then fails as a whole (ErrRolledBack).
type guardedTx struct{ pgx.Tx }

var _ pgx.Tx = guardedTx{}

// Begin opens a savepoint as the guarded transaction's does, guarded too.
func (g guardedTx) Begin(ctx context.Context) (pgx.Tx, error) {
	tx, err := g.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return guardedTx{tx}, nil
}

// Exec runs sql unless it would end the transaction.
func (g guardedTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if endsTx(sql) {
		return pgconn.CommandTag{}, ErrTxOwned
	}
	return g.Tx.Exec(ctx, sql, args...)
}

// Query runs sql unless it would end the transaction.
func (g guardedTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if endsTx(sql) {
		return nil, ErrTxOwned
	}
	return g.Tx.Query(ctx, sql, args...)
}

// QueryRow runs sql unless it would end the transaction.
func (g guardedTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if endsTx(sql) {
		return errRow{ErrTxOwned}
	}
	return g.Tx.QueryRow(ctx, sql, args...)
}

// SendBatch sends b unless one of its statements would end the
// transaction.
func (g guardedTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	for _, q := range b.QueuedQueries {
		if endsTx(q.SQL) {
			return errBatch{ErrTxOwned}
		}
	}
	return g.Tx.SendBatch(ctx, b)
}

// endsTx reports whether the statement sql begins with ends the
// transaction it runs in: COMMIT, END, ABORT, ROLLBACK (but ROLLBACK TO
// a savepoint), PREPARE TRANSACTION. Leading blanks, semicolons and
// comments are skipped; keywords are matched as Postgres does, without
// regard to case.
func endsTx(sql string) bool {
	words := leadingWords(sql, 4)
	if len(words) == 0 {
		return false
	}
	switch words[0] {
	case "commit", "end", "abort":
		return true
	case "prepare":
		return len(words) > 1 && words[1] == "transaction"
	case "rollback":
		// ROLLBACK [WORK | TRANSACTION] TO [SAVEPOINT] name keeps the
		// transaction.
		rest := words[1:]
		if len(rest) > 0 && (rest[0] == "work" || rest[0] == "transaction") {
			rest = rest[1:]
		}
		return len(rest) == 0 || rest[0] != "to"
	}
	return false
}

// leadingWords returns up to n words (runs of letters, lower-cased) at the
// start of sql, after blanks, semicolons and comments, stopping at the
// first character that is none of those.
func leadingWords(sql string, n int) []string {
	var words []string
	s := sql
	for len(words) < n {
		s = skipBlanks(s)
		i := 0
		for i < len(s) && (s[i] >= 'a' && s[i] <= 'z' || s[i] >= 'A' && s[i] <= 'Z' || s[i] == '_') {
			i++
		}
		if i == 0 {
			break
		}
		words = append(words, strings.ToLower(s[:i]))
		s = s[i:]
	}
	return words
}

// skipBlanks skips white space, semicolons, and -- and /* */ comments
// (nested, as Postgres reads them).
func skipBlanks(s string) string {
	for {
		switch {
		case len(s) > 0 && strings.ContainsRune(" \t\n\r\f\v;", rune(s[0])):
			s = s[1:]
		case strings.HasPrefix(s, "--"):
			i := strings.IndexByte(s, '\n')
			if i < 0 {
				return ""
			}
			s = s[i+1:]
		case strings.HasPrefix(s, "/*"):
			depth := 0
			i := 0
			for i < len(s) {
				switch {
				case strings.HasPrefix(s[i:], "/*"):
					depth++
					i += 2
				case strings.HasPrefix(s[i:], "*/"):
					depth--
					i += 2
				default:
					i++
				}
				if depth == 0 {
					break
				}
			}
			if depth > 0 {
				return ""
			}
			s = s[i:]
		default:
			return s
		}
	}
}
