// Package pglisten keeps one PostgreSQL connection LISTENing on a set of
// channels and hands every notification to a callback, reconnecting after
// the connection or the server goes away.
//
// A notification is delivered only if its transaction commits, and only to
// connections that were listening at that moment: after every (re)connect
// the listener calls OnListen, so callers can look again for what they may
// have missed.
package pglisten

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
)

// Config configures a Listener.
type Config struct {
	// DB is the database/sql handle over a pgx pool (stdlib); the listener
	// holds one of its connections while it runs and closes it when it
	// stops, so no pooled connection ever keeps listening. Required.
	DB *sql.DB
	// Channels to LISTEN on. Required.
	Channels []string
	// OnNotify receives every notification, on the listener's goroutine:
	// keep it short. Required.
	OnNotify func(channel, payload string)
	// OnListen is called after every successful (re)connect, once the
	// channels are listened on. Optional.
	OnListen func()
	// OnLost is called when the connection is lost, before reconnecting.
	// Optional.
	OnLost func(err error)
	// RetryInterval is the first wait before reconnecting; it doubles up to
	// MaxRetryInterval. Defaults: 100ms and 5s.
	RetryInterval    time.Duration
	MaxRetryInterval time.Duration
	// Logger. Default: slog.Default().
	Logger *slog.Logger
}

// Listener is a running LISTEN connection; see Run.
type Listener struct {
	cfg Config
}

// New validates cfg.
func New(cfg Config) (*Listener, error) {
	if cfg.DB == nil || len(cfg.Channels) == 0 || cfg.OnNotify == nil {
		return nil, errors.New("pglisten: DB, Channels and OnNotify are required")
	}
	for _, c := range cfg.Channels {
		if c == "" || len(c) > 63 {
			return nil, fmt.Errorf("pglisten: channel name must be 1 to 63 bytes, got %q", c)
		}
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = 100 * time.Millisecond
	}
	if cfg.MaxRetryInterval < cfg.RetryInterval {
		cfg.MaxRetryInterval = max(5*time.Second, cfg.RetryInterval)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Listener{cfg: cfg}, nil
}

// Run listens until ctx is done, reconnecting with backoff whenever the
// connection is lost. It returns nil when ctx is done.
func (l *Listener) Run(ctx context.Context) error {
	wait := l.cfg.RetryInterval
	for {
		listened, err := l.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if listened {
			wait = l.cfg.RetryInterval
		}
		if l.cfg.OnLost != nil {
			l.cfg.OnLost(err)
		}
		l.cfg.Logger.Warn("pglisten: connection lost; reconnecting", "channels", l.cfg.Channels, "err", err, "wait", wait)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		wait = min(2*wait, l.cfg.MaxRetryInterval)
	}
}

// session runs one connection until it fails or ctx is done; it reports
// whether the channels were listened on.
func (l *Listener) session(ctx context.Context) (listened bool, err error) {
	conn, err := l.cfg.DB.Conn(ctx)
	if err != nil {
		return false, fmt.Errorf("pglisten: connecting: %w", err)
	}
	defer conn.Close()
	err = conn.Raw(func(dc any) error {
		sc, ok := dc.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("pglisten: DB is not a pgx stdlib handle (%T)", dc)
		}
		pc := sc.Conn()
		// Whatever happens, the connection must not go back to the pool
		// still listening: close it, and tell database/sql it is gone.
		defer func() { _ = pc.Close(context.Background()) }()
		for _, ch := range l.cfg.Channels {
			if _, err := pc.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize()); err != nil {
				return errors.Join(fmt.Errorf("pglisten: LISTEN %s: %w", ch, err), driver.ErrBadConn)
			}
		}
		listened = true
		if l.cfg.OnListen != nil {
			l.cfg.OnListen()
		}
		for {
			n, err := pc.WaitForNotification(ctx)
			if err != nil {
				return errors.Join(fmt.Errorf("pglisten: waiting for notifications: %w", err), driver.ErrBadConn)
			}
			l.cfg.OnNotify(n.Channel, n.Payload)
		}
	})
	return listened, err
}
