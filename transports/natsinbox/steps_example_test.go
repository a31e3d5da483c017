package natsinbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/justonce/justonce/consumer"
	"github.com/justonce/justonce/inbox"
	"github.com/justonce/justonce/transports/natsinbox"
)

// A payment consumer in steps (consumer.Config.Steps): an order row, a
// charge at a provider, a receipt by mail. The mailer is down on the first
// attempt: the retry resumes after the order and the charge, which are
// not made again. The payment was published twice; the second copy is a
// duplicate. kafkainbox and franzinbox take the same Config and handler.
func ExampleNew_steps() {
	ex := setUp("pay-1", "pay-1") // the events, published; a migrated schema
	defer ex.tearDown()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()

	ledger, err := inbox.New(ex.pool, inbox.Config{})
	if err != nil {
		log.Fatal(err)
	}
	if _, err := ex.pool.Exec(ctx, `CREATE TABLE orders (payment text NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	charges := map[string]int{} // the provider's, by idempotency key
	var mailerUp atomic.Bool
	var answered atomic.Int32
	processor := consumer.Config{
		Ledger: ledger,
		Steps:  true, // the handler runs in steps: consumer.Steps(ctx), no tx
		Hooks: consumer.Hooks{
			OnRetry: func(m *consumer.Message, err error) { fmt.Println(m.ID, "retry:", err) },
			OnOutcome: func(m *consumer.Message, out inbox.Outcome, _ time.Duration) {
				if out.Disposition == inbox.Executed || out.Disposition == inbox.Duplicate {
					fmt.Println(m.ID, out.Disposition, string(out.Result.Body))
					if answered.Add(1) == 2 {
						stop()
					}
				}
			}},
	}
	handler := func(ctx context.Context, _ pgx.Tx, m *consumer.Message) error {
		s := consumer.Steps(ctx)
		if _, err := s.Tx(ctx, "order", func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			_, err := tx.Exec(ctx, `INSERT INTO orders (payment) VALUES ($1)`, m.ID)
			return nil, err
		}); err != nil {
			return err
		}
		charge, err := s.Call(ctx, "charge", func(ctx context.Context, key string) ([]byte, error) {
			charges[key]++ // key, inbox.StepKey(s.Key(), "charge"): the provider's idempotency key
			return []byte(fmt.Sprintf("ch_%d", len(charges))), nil
		})
		if err != nil {
			return err
		}
		if _, err := s.Call(ctx, "receipt", func(ctx context.Context, key string) ([]byte, error) {
			if !mailerUp.Swap(true) {
				return nil, errors.New("mailer down") // retried: the steps recorded stay
			}
			return nil, nil
		}); err != nil {
			return err
		}
		consumer.SetResult(ctx, inbox.Result{Body: charge}) // replayed to duplicates
		return nil
	}

	c, err := natsinbox.New(natsinbox.Config{Conn: ex.conn, Stream: ex.stream, Durable: "payments", Processor: processor}, handler)
	if err != nil {
		log.Fatal(err)
	}
	if err := c.Run(ctx); err != nil {
		log.Fatal(err)
	}
	var orders int
	if err := ex.pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&orders); err != nil {
		log.Fatal(err)
	}
	fmt.Println("orders:", orders, "charges:", len(charges))
	// Output:
	// pay-1 retry: mailer down
	// pay-1 executed ch_1
	// pay-1 duplicate ch_1
	// orders: 1 charges: 1
}
