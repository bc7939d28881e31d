package testdb

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
)

// The tests of a run and its server-wide turns (ServerWide) share the
// server as readers and writers do, across the run's processes (one per
// package): a test that uses the server (Shared, Fresh, Empty, Custom,
// Open) holds a share of it until it ends; a turn begins once no test of
// another process holds one, and no test starts while it lasts. A test
// that saturates the server (sagabench's runs) then takes no connection
// another test needed: on a server of 100 connections, tests of other
// packages failed with "sorry, too many clients already" while one ran.
//
// Each process holds the turn's lock in shared mode, on one connection,
// while any of its tests holds a share. A test passes the gate before it
// takes its share; a turn holds the gate from the time it asks, so that a
// process whose tests overlap does not keep its share, and the turn
// waiting, until the package ends.
const gateLockID int64 = 0x7067736167610005

var share = struct {
	// gateMu guards gate, the connection on which tests pass the gate.
	gateMu sync.Mutex
	gate   *pgx.Conn

	mu    sync.Mutex
	conn  *pgx.Conn       // holds the process's share while held
	held  bool            // conn holds the turn's lock in shared mode
	tests map[string]bool // names of the tests holding a share
	turns int             // server-wide turns this process holds

	// The locks, which the package's own tests replace by their own.
	turnID, gateID int64
}{tests: map[string]bool{}, turnID: serverWideLockID, gateID: gateLockID}

// shareServer makes t hold a share of the server until it ends, unless it
// or a test it is part of holds one (a subtest must not wait at the gate
// for a turn that waits for its parent), or a test of this process holds a
// turn (its tests run beside it, as they did before it began).
func shareServer(t testing.TB) {
	t.Helper()
	share.mu.Lock()
	covered := coveredLocked(t.Name())
	share.mu.Unlock()
	if covered {
		return
	}
	passGate(t)
	share.mu.Lock()
	defer share.mu.Unlock()
	name := t.Name()
	if coveredLocked(name) {
		return
	}
	if !share.held {
		if share.conn == nil {
			share.conn = serverConn(t)
		}
		if _, err := share.conn.Exec(context.Background(), "SELECT pg_advisory_lock_shared($1)", share.turnID); err != nil {
			t.Fatalf("testdb: waiting for a share of the server: %v", err)
		}
		share.held = true
	}
	share.tests[name] = true
	t.Cleanup(func() {
		share.mu.Lock()
		defer share.mu.Unlock()
		delete(share.tests, name)
		if len(share.tests) == 0 {
			releaseShareLocked()
		}
	})
}

// coveredLocked reports whether the test named name, or one it is part
// of, holds a share, or this process holds a turn.
func coveredLocked(name string) bool {
	if share.turns > 0 {
		return true
	}
	for {
		if share.tests[name] {
			return true
		}
		i := strings.LastIndexByte(name, '/')
		if i < 0 {
			return false
		}
		name = name[:i]
	}
}

// passGate waits while a turn holds the gate, having closed the idle
// connections of the process for it.
func passGate(t testing.TB) {
	t.Helper()
	share.gateMu.Lock()
	defer share.gateMu.Unlock()
	if share.gate == nil {
		share.gate = serverConn(t)
	}
	ctx := context.Background()
	if !turnAsked(share.gate, share.gateID) {
		return
	}
	closeIdle()
	if _, err := share.gate.Exec(ctx, "SELECT pg_advisory_lock_shared($1)", share.gateID); err != nil {
		t.Fatalf("testdb: waiting at the gate for a server-wide turn to end: %v", err)
	}
	if _, err := share.gate.Exec(ctx, "SELECT pg_advisory_unlock_shared($1)", share.gateID); err != nil {
		t.Fatalf("testdb: passing the gate: %v", err)
	}
}

// releaseShareLocked gives up the process's share, if it holds it, and,
// if a turn is asked for, the idle connections the turn may need.
func releaseShareLocked() {
	if !share.held {
		return
	}
	share.held = false
	if _, err := share.conn.Exec(context.Background(), "SELECT pg_advisory_unlock_shared($1)", share.turnID); err != nil {
		// Closing the connection releases it too.
		_ = share.conn.Close(context.Background())
		share.conn = nil
		return
	}
	if share.turns == 0 && turnAsked(share.conn, share.gateID) {
		closeIdle()
	}
}

// turnAsked reports whether a turn holds the gate (gateID), passing it on
// conn if not: tests that see it taken close their process's idle
// connections, which a turn counts as used (FreeConnections).
func turnAsked(conn *pgx.Conn, gateID int64) bool {
	ctx := context.Background()
	var passed bool
	if err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock_shared($1)", gateID).Scan(&passed); err != nil {
		return true // the blocking wait says what is wrong
	}
	if passed {
		_, _ = conn.Exec(ctx, "SELECT pg_advisory_unlock_shared($1)", gateID)
	}
	return !passed
}

// closeIdle closes the idle connections of the package's database (those
// in use close when given back); the next test opens new ones.
func closeIdle() {
	mu.Lock()
	db := shared
	mu.Unlock()
	if db != nil {
		db.Pool.Reset()
	}
}

// holdTurn takes the server-wide turn on conn: the gate first, then the
// process's share is given up (its tests under way go on beside the turn),
// then the turn, once no other process holds a share. It returns with the
// turn held, or fails the test; a cleanup gives the turn back and takes the
// share again for the tests still under way.
func holdTurn(t testing.TB, conn *pgx.Conn) {
	t.Helper()
	ctx := context.Background()
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", share.gateID); err != nil {
		_ = conn.Close(ctx)
		t.Fatalf("testdb: waiting for a server-wide turn: %v", err)
	}
	share.mu.Lock()
	share.turns++
	releaseShareLocked()
	share.mu.Unlock()
	t.Cleanup(func() {
		_ = conn.Close(context.Background()) // releases the gate and the turn
		share.mu.Lock()
		defer share.mu.Unlock()
		share.turns--
		if share.turns > 0 || len(share.tests) == 0 || share.held {
			return
		}
		if share.conn == nil {
			share.conn = serverConn(t)
		}
		if _, err := share.conn.Exec(context.Background(), "SELECT pg_advisory_lock_shared($1)", share.turnID); err != nil {
			t.Errorf("testdb: taking the share of the tests under way again: %v", err)
			return
		}
		share.held = true
	})
	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", share.turnID); err != nil {
		t.Fatalf("testdb: waiting for a server-wide turn: %v", err)
	}
}

// closeShare closes the process's connections for sharing, once its tests
// have ended.
func closeShare() {
	share.mu.Lock()
	if share.conn != nil {
		_ = share.conn.Close(context.Background())
		share.conn, share.held = nil, false
	}
	share.mu.Unlock()
	share.gateMu.Lock()
	if share.gate != nil {
		_ = share.gate.Close(context.Background())
		share.gate = nil
	}
	share.gateMu.Unlock()
}
