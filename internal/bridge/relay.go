package bridge

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps/broker"
)

// heldRecheck is how soon a relay looks again while another holds its
// topic: should the holder die, its transaction ends and nobody says so.
const heldRecheck = time.Second

// relay relays one topic: batches from the head of its queue, each
// message published before the next, until the queue is empty; then it
// waits for a wake-up.
type relay struct {
	b     *Bridge
	topic string
	bound time.Duration // of one publish
}

func (r *relay) run(ctx context.Context) {
	tc := r.b.t.Config()
	wake, listening, stop := r.b.t.Wakeups(r.topic)
	defer stop()
	var (
		errWait time.Duration
		failing bool
	)
	for ctx.Err() == nil {
		more, err := r.batch(ctx)
		var wait time.Duration
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, transport.ErrRelayHeld):
			wait = heldRecheck
		case err != nil:
			if errWait == 0 {
				errWait = tc.RetryInterval
			} else {
				errWait = min(2*errWait, tc.MaxRetryInterval)
			}
			wait = errWait
			level := r.b.log.Warn
			if failing {
				level = r.b.log.Error
			}
			level("relay stopped at a message it could not relay; trying again", "topic", r.topic, "wait", wait, "err", err)
			failing = true
			r.b.t.Metrics().RelayFailed(r.topic)
		case more:
			errWait = 0
			if failing {
				r.b.log.Info("relay going again", "topic", r.topic)
				failing = false
			}
			continue
		default:
			errWait = 0
			if failing {
				r.b.log.Info("relay going again", "topic", r.topic)
				failing = false
			}
			wait = tc.IdlePollInterval
			if !listening() {
				wait = tc.PollInterval
			}
		}
		if !sleep(ctx, wake, wait, err == nil) {
			return
		}
	}
}

// sleep waits d, or until a wake-up if woken is true; false once ctx is
// done.
func sleep(ctx context.Context, wake <-chan struct{}, d time.Duration, woken bool) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	if !woken {
		wake = nil
	}
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
	case <-wake:
	}
	return true
}

// publish publishes msg to the broker; a panic of the broker's client is
// this message's failure (a transport.PanicError, which the relay
// dead-letters: the same message would panic again), its stack logged.
func (r *relay) publish(ctx context.Context, msg *message.Message) (err error) {
	defer func() {
		if p := recover(); p != nil {
			perr := transport.Recovered("publishing to the broker", p)
			r.b.log.Error("publishing a message to the broker panicked", "topic", r.topic, "message_uuid", transport.Storable(msg.UUID),
				"panic", perr.Value, "stack", string(perr.Stack))
			err = perr
		}
	}()
	return r.b.cfg.Broker.Publish(ctx, r.topic, msg)
}

// batch relays one batch: it reports whether more messages may wait.
func (r *relay) batch(ctx context.Context) (more bool, err error) {
	b, err := r.b.t.ClaimRelay(ctx, r.topic, r.b.cfg.BatchSize)
	if err != nil {
		return false, err
	}
	defer b.Rollback()
	tc := r.b.t.Config()
	// No publish starts that could outlast the transaction: the batch
	// stops at BatchTimeout, and earlier if the broker's bound leaves too
	// little of the transaction's (New checks that one publish fits).
	lastStart := b.Started().Add(relayWindow(tc) - r.bound)
	relayed := 0
	var pubErr error
	for i, msg := range b.Messages {
		if i > 0 && (time.Since(b.Started()) > tc.BatchTimeout || time.Now().After(lastStart) || ctx.Err() != nil) {
			more = true
			break
		}
		if err := r.publish(ctx, msg); err != nil {
			if r.b.cfg.Broker.Permanent(err) || errors.Is(err, transport.ErrHandlerPanicked) {
				b.DeadLetter(i, "the broker refuses it: "+err.Error())
				r.b.log.Error("message dead-lettered: the broker refuses it", "topic", r.topic, "message_uuid", msg.UUID, "err", err)
				continue
			}
			pubErr = fmt.Errorf("publishing %s to the broker: %w", msg.UUID, err)
			break
		}
		if f := r.b.cfg.Faults; f != nil && f.CrashAfterPublish(r.topic, msg) {
			return false, broker.ErrRelayCrashed
		}
		b.Relayed(i)
		relayed++
	}
	if b.Claimed() >= r.b.cfg.BatchSize {
		more = true
	}
	dead := b.DeadLettered()
	if err := b.Commit(); err != nil {
		return false, errors.Join(pubErr, err)
	}
	r.b.relayed.Add(int64(relayed))
	r.b.deadLettered.Add(int64(dead))
	r.b.t.Metrics().Relayed(r.topic, relayed)
	if relayed > 0 {
		r.b.log.Debug("relayed", "topic", r.topic, "messages", relayed)
	}
	return more && pubErr == nil, pubErr
}
