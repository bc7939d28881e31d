package transport

import (
	"fmt"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

// BatchLoad is what LoadPerBatch loads for a batch.
type BatchLoad struct {
	// Key names what msg's handler reads: the key its attempt asks
	// Preloaded for, and the row of arguments that load it; ok false when
	// it reads nothing the batch can load. It runs on the subscriber's
	// goroutine, before any middleware.
	Key func(msg *message.Message) (key string, args []any, ok bool)
	// Statement loads the rows of every message of the batch (a row of
	// args each, keys distinct), in one statement. It must not wait for
	// row locks held by others (FOR UPDATE SKIP LOCKED, say): a row it
	// does not return is read by its attempt, as without LoadPerBatch.
	Statement func(args [][]any) (query string, qargs []any)
	// Scan reads one row of the statement: the key it is for and the
	// value Preloaded hands out.
	Scan func(rows pgx.Rows) (key string, value any, err error)
}

// key is Key; a panic of it loads nothing for msg (its attempt reads, and
// meets the fault itself, if it is its handler's).
func (l *BatchLoad) key(msg *message.Message) (key string, args []any, ok bool) {
	defer func() {
		if recover() != nil {
			key, args, ok = "", nil, false
		}
	}()
	return l.Key(msg)
}

// scan is Scan; a panic of it fails the load.
func (l *BatchLoad) scan(rows pgx.Rows) (key string, v any, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("transport: reading a batch's load panicked: %v", p)
		}
	}()
	return l.Scan(rows)
}

// LoadPerBatch makes the handler's consumers load what the handler reads,
// for all the messages of a batch, in one statement, before the batch's
// first attempt, in the round trip that claims the batch's keys (see
// ClaimKeysPerBatch). An attempt takes its message's value with
// Preloaded; a value is handed out once, and what was not loaded (a batch
// of one message, a row locked by another transaction, a load that
// failed) the handler reads itself. Router handlers only.
//
// A value is what the row held when the batch began: the handler must
// make sure no earlier attempt of the same transaction changed the row
// since, as by writing it back only where its version is the one it read,
// failing the attempt otherwise.
func LoadPerBatch(l BatchLoad) HandlerOption {
	return func(o *handlerOptions) { o.load = &l }
}

// loadRequest is what a message of a batch reads.
type loadRequest struct {
	key  string
	args []any
}

// batchLoads are the values a batch loaded up front.
type batchLoads struct {
	mu     sync.Mutex
	values map[string]any
}

// take hands out the value loaded for key, once.
func (l *batchLoads) take(key string) (any, bool) {
	if l == nil {
		return nil, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	v, ok := l.values[key]
	if ok {
		delete(l.values, key)
	}
	return v, ok
}

// drop forgets the values no attempt took.
func (l *batchLoads) drop() {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	clear(l.values)
}

// Preloaded returns the value LoadPerBatch loaded for key in the batch of
// tx, the transaction of a delivery attempt, and forgets it: ok false if
// none was (see LoadPerBatch), or it was handed out already.
func Preloaded(tx Tx, key string) (any, bool) {
	a, ok := tx.(*attemptTx)
	if !ok || a.d == nil {
		return nil, false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.over {
		return nil, false
	}
	return a.d.loads.take(key)
}

// loadStatement is the statement that loads the batch's rows and its
// reader, or ok false when there is nothing worth loading (one row costs
// what its attempt's read would).
func (c *consumer) loadStatement(reqs []loadRequest) (s stmt, read func(pgx.Rows) error, loads *batchLoads, ok bool) {
	bl := c.rt.load
	if bl == nil {
		return stmt{}, nil, nil, false
	}
	var args [][]any
	seen := map[string]bool{}
	for _, r := range reqs {
		if seen[r.key] {
			continue
		}
		seen[r.key] = true
		args = append(args, r.args)
	}
	if len(args) < 2 {
		return stmt{}, nil, nil, false
	}
	q, qargs := bl.Statement(args)
	loads = &batchLoads{values: map[string]any{}}
	read = func(rows pgx.Rows) error {
		for rows.Next() {
			key, v, err := bl.scan(rows)
			if err != nil {
				return err
			}
			if seen[key] {
				loads.values[key] = v
			}
		}
		return rows.Err()
	}
	return stmt{name: "loading the batch's rows", query: q, args: qargs}, read, loads, true
}
