// Package sagatest is pgsaga's failure-recovery test kit: point it at your
// own sagas and participants to prove that nothing is ever done twice or
// lost when messages are duplicated, processes crash at commit boundaries,
// connections die mid-step and workers come and go.
//
// Its unit tier runs one step (Step), or a saga's reactions one at a time
// (Transitions: its start, then the engine's answer to each reply), in a
// transaction rolled back at the end, with no worker:
//
//	res := sagatest.Step(t, client, reserve, ReserveRoom{Guest: "ada"}, nil)
//	reply, err := steps.Decode[RoomReserved](res.Reply)
//	run := sagatest.Transitions(t, client, "stay", Booked{Guest: "ada"}, nil, sagatest.Refuse(nil, "no room"))
//	last := run.Last().Instance // compensated
//
// Its failure tier: in a test, New starts a Run on a database (DB gives the test one of its
// own; the package's TestMain calls Main): install Run.Intercept as the
// client's delivery.Config.Intercept, register what the client serves,
// Start churning its workers, start sagas, and Finish, which waits for
// them, stops everything and fails the test for every broken invariant:
//
//	func TestMyRecovery(t *testing.T) {
//		db := sagatest.DB(t)
//		run := sagatest.New(t, db.SQL, sagatest.Faults{Seed: 7, DuplicateRate: 0.3, CrashBeforeCommitRate: 0.1})
//		client, _ := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Transport: delivery.Config{Intercept: run.Intercept}})
//		// client.Register(...), client.AddSteps(...)
//		run.Start(client, 2)
//		// ids: the sagas started (client.StartTx)
//		run.Finish(time.Minute, ids, defs, myInvariants...)
//	}
//
// Underneath are three parts, usable on their own (see Example):
//
//   - Injector injects faults into every handler of a transport (install
//     Injector.Intercept as delivery.Config.Intercept): duplicate
//     deliveries (copies published later, out of order), crashes before
//     commit (the work is done, then the attempt fails and rolls back),
//     crashes after commit before the ack (the message is delivered again
//     after its effects committed), killed database connections
//     (pg_terminate_backend of the step's own backend), and slow handling.
//   - Churn runs several independent workers over the same database,
//     starting and stopping them at random.
//   - Checker checks the generic invariants (every saga terminal, none
//     parked, no pending idempotency key, every command's effect at most
//     once, no command lost) and your domain's, reporting the offending
//     rows.
//
// Faults are decided from a seed: the n-th time a handler sees a message,
// the same seed makes the same decision, whatever the scheduling. Print the
// seed on failure and run again with it.
package sagatest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/steps"
)

// Faults says what to inject. Rates are probabilities from 0 to 1.
type Faults struct {
	// Seed makes the faults reproducible: each is drawn from the seed, the
	// handler, the message, its delivery attempt and how often this
	// injector saw it. Zero is a valid seed.
	Seed uint64

	// DuplicateRate is the share of consumed messages that are delivered
	// again: each gets 1 to MaxCopies copies (same UUID, payload and
	// metadata), published at random moments within MaxCopyDelay, so they
	// arrive late and out of order. A message delivered in process
	// (transport.InProcess) exists only if its publisher commits: its
	// copies are queued in that transaction and arrive right after the
	// commit. Copies are not copied again.
	DuplicateRate float64
	// MaxCopies per duplicated message. Default: 2.
	MaxCopies int
	// MaxCopyDelay bounds how late a copy is published. Default: 300ms.
	MaxCopyDelay time.Duration

	// CrashBeforeCommitRate is the share of attempts that do all their work
	// and then fail, as if the process died before committing: the work is
	// rolled back and the message handled again.
	CrashBeforeCommitRate float64
	// CrashAfterCommitRate is the share of successful attempts whose message
	// is delivered again after its transaction committed, as if the process
	// died after committing but before the ack. (The copy is published
	// through the attempt's transaction, so it exists only if the attempt's
	// work does.)
	CrashAfterCommitRate float64
	// KillConnectionRate is the share of attempts whose database connection
	// is killed (pg_terminate_backend) after the handler's work, before
	// commit. A killed connection costs its whole batch (redelivered), so
	// keep it well below 1/BatchSize or batches never get through.
	KillConnectionRate float64

	// DelayRate is the share of attempts that wait up to MaxDelay before
	// handling the message: slow participants, late replies.
	DelayRate float64
	// MaxDelay of a delayed attempt. Default: 100ms.
	MaxDelay time.Duration

	// Skip leaves the named handlers alone. Default: none.
	Skip func(handler string) bool
}

func (f *Faults) setDefaults() {
	if f.MaxCopies == 0 {
		f.MaxCopies = 2
	}
	if f.MaxCopyDelay == 0 {
		f.MaxCopyDelay = 300 * time.Millisecond
	}
	if f.MaxDelay == 0 {
		f.MaxDelay = 100 * time.Millisecond
	}
}

func (f Faults) validate() error {
	for name, r := range map[string]float64{
		"DuplicateRate": f.DuplicateRate, "CrashBeforeCommitRate": f.CrashBeforeCommitRate,
		"CrashAfterCommitRate": f.CrashAfterCommitRate, "KillConnectionRate": f.KillConnectionRate, "DelayRate": f.DelayRate,
	} {
		if r < 0 || r > 1 || math.IsNaN(r) {
			return fmt.Errorf("sagatest: %s must be between 0 and 1, got %v", name, r)
		}
	}
	if f.CrashBeforeCommitRate+f.CrashAfterCommitRate+f.KillConnectionRate > 1 {
		return errors.New("sagatest: CrashBeforeCommitRate + CrashAfterCommitRate + KillConnectionRate must not exceed 1")
	}
	if f.MaxCopies < 1 || f.MaxCopyDelay < 0 || f.MaxDelay < 0 {
		return errors.New("sagatest: MaxCopies must be positive, delays not negative")
	}
	return nil
}

// CopyMetadata marks a copy the Injector published.
const CopyMetadata = "sagatest_copy"

// Stats counts what the Injector did.
type Stats struct {
	Attempts          int // handler attempts seen
	Retries           int // attempts of a message the handler had seen before
	Duplicated        int // messages that got copies
	Copies            int // copies published
	CrashesBefore     int // attempts crashed before commit
	CrashesAfter      int // redeliveries after commit queued (some roll back with their batch)
	ConnectionsKilled int
	Delays            int
	// Replayed counts deliveries of replies a participant published again
	// for a duplicate command (steps.MetaReplayed), first attempts
	// only.
	Replayed int
}

// Add is s and o counted together: the stats of several injectors (one
// per database of services joined by a broker).
func (s Stats) Add(o Stats) Stats {
	s.Attempts += o.Attempts
	s.Retries += o.Retries
	s.Duplicated += o.Duplicated
	s.Copies += o.Copies
	s.CrashesBefore += o.CrashesBefore
	s.CrashesAfter += o.CrashesAfter
	s.ConnectionsKilled += o.ConnectionsKilled
	s.Delays += o.Delays
	s.Replayed += o.Replayed
	return s
}

// Injector injects faults into handlers.
type Injector struct {
	cfg  Faults
	db   *sql.DB
	pub  *transport.Transport
	log  *slog.Logger
	stop chan struct{}
	wg   sync.WaitGroup

	mu    sync.Mutex
	seen  map[string]int // handler + message → attempts
	first map[string]bool
	stats Stats
}

// NewInjector returns an Injector that publishes copies and kills
// connections through db (the application's database).
func NewInjector(db *sql.DB, f Faults, logger *slog.Logger) (*Injector, error) {
	f.setDefaults()
	if err := f.validate(); err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("sagatest: NewInjector needs the database")
	}
	if logger == nil {
		logger = slog.Default()
	}
	pub, err := transport.New(transport.Config{DB: db, Logger: logger})
	if err != nil {
		return nil, err
	}
	return &Injector{cfg: f, db: db, pub: pub, log: logger, stop: make(chan struct{}),
		seen: map[string]int{}, first: map[string]bool{}}, nil
}

// Stats returns what the Injector did so far.
func (i *Injector) Stats() Stats {
	i.mu.Lock()
	defer i.mu.Unlock()
	return i.stats
}

// Flush waits until every scheduled copy has been published.
func (i *Injector) Flush() { i.wg.Wait() }

// Close drops the copies not yet published and waits for those in progress.
func (i *Injector) Close() error {
	select {
	case <-i.stop:
	default:
		close(i.stop)
	}
	i.wg.Wait()
	return nil
}

// chance is a uniform number in [0, 1) decided by the seed and the parts.
func (i *Injector) chance(parts ...string) float64 { return chance(i.cfg.Seed, parts...) }

// Intercept is a delivery.Config.Intercept that injects the faults.
func (i *Injector) Intercept(handler string, h message.NoPublishHandlerFunc) message.NoPublishHandlerFunc {
	if i.cfg.Skip != nil && i.cfg.Skip(handler) {
		return h
	}
	return func(msg *message.Message) error {
		ctx := msg.Context()
		topic := transport.TopicFromContext(ctx) // queued or in process
		i.mu.Lock()
		i.seen[handler+"\x00"+msg.UUID]++
		seen := i.seen[handler+"\x00"+msg.UUID]
		// Faults are drawn per (handler, message, delivery attempt, time
		// seen here). The attempt is the transport's, recorded in the
		// database: a process restarted after a kill counts from one again,
		// and without it would draw the faults it drew before, failing the
		// same message on the same sighting in every process until its
		// attempts ran out.
		n := strconv.Itoa(transport.AttemptFromContext(ctx)) + "." + strconv.Itoa(seen)
		i.stats.Attempts++
		if seen != 1 {
			i.stats.Retries++
		}
		firstSight := !i.first[topic+"\x00"+msg.UUID] && msg.Metadata.Get(CopyMetadata) == ""
		i.first[topic+"\x00"+msg.UUID] = true
		if msg.Metadata.Get(steps.MetaReplayed) == "true" && transport.AttemptFromContext(ctx) == 1 {
			i.stats.Replayed++
		}
		i.mu.Unlock()

		if firstSight && topic != "" && i.chance("duplicate", topic, msg.UUID) < i.cfg.DuplicateRate {
			if !transport.InProcessFromContext(ctx) {
				i.scheduleCopies(topic, msg)
			} else if err := i.copyInTx(ctx, topic, msg); err != nil {
				return err
			}
		}
		if i.chance("delay", handler, msg.UUID, n) < i.cfg.DelayRate {
			i.count(func(s *Stats) { s.Delays++ })
			time.Sleep(time.Duration(i.chance("delay-for", handler, msg.UUID, n) * float64(i.cfg.MaxDelay)))
		}

		if err := h(msg); err != nil {
			return err
		}

		r := i.chance("crash", handler, msg.UUID, n)
		switch {
		case r < i.cfg.CrashBeforeCommitRate:
			i.count(func(s *Stats) { s.CrashesBefore++ })
			return ErrInjectedCrash
		case r < i.cfg.CrashBeforeCommitRate+i.cfg.KillConnectionRate:
			return i.killConnection(ctx, handler, msg)
		case r < i.cfg.CrashBeforeCommitRate+i.cfg.KillConnectionRate+i.cfg.CrashAfterCommitRate && topic != "":
			tx, ok := transport.TxFromContext(ctx)
			if !ok {
				return nil
			}
			// Queued, never in process: it is to arrive after the commit.
			if err := i.pub.QueuedPublisher(tx).Publish(topic, copyOf(msg, "after-commit")); err != nil {
				return fmt.Errorf("sagatest: redelivering %s after commit: %w", msg.UUID, err)
			}
			i.count(func(s *Stats) { s.CrashesAfter++ })
		}
		return nil
	}
}

// killConnection terminates the backend of the attempt's transaction, from
// another connection.
func (i *Injector) killConnection(ctx context.Context, handler string, msg *message.Message) error {
	tx, ok := transport.TxFromContext(ctx)
	if !ok {
		return nil
	}
	var pid int
	if err := tx.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		return err
	}
	if _, err := i.db.ExecContext(context.WithoutCancel(ctx), `SELECT pg_terminate_backend($1)`, pid); err != nil {
		return fmt.Errorf("sagatest: killing the connection of %s: %w", handler, err)
	}
	i.count(func(s *Stats) { s.ConnectionsKilled++ })
	// The attempt's next statement fails: the transaction is gone.
	_, err := tx.ExecContext(ctx, `SELECT 1`)
	if err == nil {
		err = errors.New("sagatest: connection killed")
	}
	return err
}

// copyInTx duplicates a message delivered in process: it exists only in
// its publisher's transaction, so its copies are queued in that
// transaction and exist only if it commits (a broker redelivers what was
// sent, never what was rolled back). They arrive right after the commit.
func (i *Injector) copyInTx(ctx context.Context, topic string, msg *message.Message) error {
	tx, ok := transport.TxFromContext(ctx)
	if !ok {
		return nil
	}
	copies := min(1+int(i.chance("copies", topic, msg.UUID)*float64(i.cfg.MaxCopies)), i.cfg.MaxCopies)
	for c := range copies {
		if err := i.pub.QueuedPublisher(tx).Publish(topic, copyOf(msg, strconv.Itoa(c+1))); err != nil {
			return fmt.Errorf("sagatest: copying %s: %w", msg.UUID, err)
		}
	}
	i.count(func(s *Stats) { s.Duplicated++; s.Copies += copies })
	return nil
}

func (i *Injector) scheduleCopies(topic string, msg *message.Message) {
	copies := 1 + int(i.chance("copies", topic, msg.UUID)*float64(i.cfg.MaxCopies))
	copies = min(copies, i.cfg.MaxCopies)
	i.count(func(s *Stats) { s.Duplicated++ })
	for c := range copies {
		delay := time.Duration(i.chance("copy-delay", topic, msg.UUID, strconv.Itoa(c)) * float64(i.cfg.MaxCopyDelay))
		cp := copyOf(msg, strconv.Itoa(c+1))
		i.wg.Go(func() {
			select {
			case <-time.After(delay):
			case <-i.stop:
				return
			}
			if err := i.pub.Publisher(i.db).Publish(topic, cp); err != nil {
				i.log.Warn("sagatest: publishing a copy", "topic", topic, "message_uuid", cp.UUID, "err", err)
				return
			}
			i.count(func(s *Stats) { s.Copies++ })
		})
	}
}

func copyOf(msg *message.Message, mark string) *message.Message {
	cp := message.NewMessage(msg.UUID, append([]byte(nil), msg.Payload...))
	for k, v := range msg.Metadata {
		cp.Metadata.Set(k, v)
	}
	cp.Metadata.Set(CopyMetadata, mark)
	return cp
}

func (i *Injector) count(f func(*Stats)) {
	i.mu.Lock()
	defer i.mu.Unlock()
	f(&i.stats)
}
