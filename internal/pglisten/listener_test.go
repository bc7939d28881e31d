package pglisten_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/pglisten"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
)

func TestMain(m *testing.M) { testpg.Main(m) }

type inbox struct {
	mu   sync.Mutex
	got  []string
	more chan struct{}
}

func newInbox() *inbox { return &inbox{more: make(chan struct{}, 1000)} }

func (b *inbox) add(ch, payload string) {
	b.mu.Lock()
	b.got = append(b.got, ch+":"+payload)
	b.mu.Unlock()
	b.more <- struct{}{}
}

func (b *inbox) waitFor(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		b.mu.Lock()
		for _, g := range b.got {
			if g == want {
				b.mu.Unlock()
				return
			}
		}
		b.mu.Unlock()
		select {
		case <-b.more:
		case <-deadline:
			t.Fatalf("no notification %q; got %v", want, b.got)
		}
	}
}

// Notifications arrive on commit only; after the listening connection is
// killed the listener reconnects, says so, and hears later notifications;
// when it stops, no pooled connection is left listening.
func TestListenerReconnects(t *testing.T) {
	t.Parallel()
	db := testdb.Fresh(t)
	box := newInbox()
	var listens atomic.Int32
	listened := make(chan struct{}, 10)
	l, err := pglisten.New(pglisten.Config{
		DB: db.SQL, Channels: []string{"chan_a", "chan_b"}, OnNotify: box.add,
		OnListen:      func() { listens.Add(1); listened <- struct{}{} },
		RetryInterval: 10 * time.Millisecond,
	})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // a failed require: else the pool's close waits for the listening connection forever
	done := make(chan error, 1)
	go func() { done <- l.Run(ctx) }()
	waitSignal(t, listened)

	tx, err := db.SQL.Begin()
	require.NoError(t, err)
	_, err = tx.Exec(`SELECT pg_notify('chan_a', 'rolled back')`)
	require.NoError(t, err)
	require.NoError(t, tx.Rollback())
	_, err = db.SQL.Exec(`SELECT pg_notify('chan_a', 'one')`)
	require.NoError(t, err)
	box.waitFor(t, "chan_a:one")

	// Kill the listening backend: the listener comes back.
	_, err = db.SQL.Exec(`SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE datname = current_database() AND query LIKE 'LISTEN %' AND pid <> pg_backend_pid()`)
	require.NoError(t, err)
	waitSignal(t, listened)
	_, err = db.SQL.Exec(`SELECT pg_notify('chan_b', 'two')`)
	require.NoError(t, err)
	box.waitFor(t, "chan_b:two")
	assert.Equal(t, int32(2), listens.Load())

	cancel()
	require.NoError(t, <-done)
	box.mu.Lock()
	assert.NotContains(t, box.got, "chan_a:rolled back")
	box.mu.Unlock()
	// The listening connection was closed, not returned to the pool.
	var listening int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pg_listening_channels()`).Scan(&listening))
	assert.Zero(t, listening, "a pooled connection still listens")
	deadline := time.Now().Add(10 * time.Second)
	for {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'LISTEN %'`).Scan(&n))
		if n == 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the listening backend is still there")
		time.Sleep(10 * time.Millisecond)
	}
}

func TestListenerConfig(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	for _, cfg := range []pglisten.Config{
		{Channels: []string{"a"}, OnNotify: func(string, string) {}},
		{DB: db.SQL, OnNotify: func(string, string) {}},
		{DB: db.SQL, Channels: []string{"a"}},
		{DB: db.SQL, Channels: []string{""}, OnNotify: func(string, string) {}},
	} {
		_, err := pglisten.New(cfg)
		require.Error(t, err)
	}
}

func waitSignal(t *testing.T, ch chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("timed out")
	}
}
