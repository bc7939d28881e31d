package testdb

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// privateLocks makes this process share the server on locks of the test's
// own, so that no other package's tests (nor turns) take part.
func privateLocks(t *testing.T) (turn, gate int64) {
	t.Helper()
	share.gateMu.Lock()
	defer share.gateMu.Unlock()
	share.mu.Lock()
	defer share.mu.Unlock()
	require.False(t, share.held || len(share.tests) > 0 || share.turns > 0, "the process shares the server already")
	turn, gate = randomLockID(), randomLockID()
	saved := [2]int64{share.turnID, share.gateID}
	share.turnID, share.gateID = turn, gate
	t.Cleanup(func() {
		share.gateMu.Lock()
		defer share.gateMu.Unlock()
		share.mu.Lock()
		defer share.mu.Unlock()
		share.turnID, share.gateID = saved[0], saved[1]
	})
	return turn, gate
}

func randomLockID() int64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return int64(binary.BigEndian.Uint64(b[:]) >> 1)
}

// otherProcess is a connection standing for another process of the run,
// closed when the test ends.
func otherProcess(t *testing.T) *pgx.Conn {
	conn := serverConn(t)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func execOn(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	_, err := conn.Exec(context.Background(), sql, args...)
	require.NoError(t, err)
}

// turnFree reports whether another process could take the turn now.
func turnFree(t *testing.T, other *pgx.Conn, turn int64) bool {
	t.Helper()
	var got bool
	require.NoError(t, other.QueryRow(context.Background(), "SELECT pg_try_advisory_lock($1)", turn).Scan(&got))
	if got {
		execOn(t, other, "SELECT pg_advisory_unlock($1)", turn)
	}
	return got
}

// shareHeld reports whether a session holds the advisory lock id in
// shared mode.
func shareHeld(t *testing.T, conn *pgx.Conn, id int64) bool {
	t.Helper()
	var held bool
	require.NoError(t, conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND granted
    AND mode = 'ShareLock' AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $1)`, id).Scan(&held))
	return held
}

// waitForLockWait waits until a session waits for one of the advisory
// locks ids.
func waitForLockWait(t *testing.T, conn *pgx.Conn, ids ...int64) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		var waiting bool
		require.NoError(t, conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
    AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = ANY ($1::bigint[]))`, ids).Scan(&waiting))
		if waiting {
			return
		}
		require.True(t, time.Now().Before(deadline), "no session waits for locks %v", ids)
		time.Sleep(10 * time.Millisecond) // the other session's progress, not this test's work
	}
}

// within fails the test unless done closes within 30 seconds.
func within(t *testing.T, done <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s: not within 30s", what)
	}
}

// askForTurn makes other ask for a turn as ServerWide does: it takes the
// gate, then waits for the turn; the channel says when it has it.
func askForTurn(t *testing.T, other *pgx.Conn, turn, gate int64) <-chan error {
	t.Helper()
	execOn(t, other, "SELECT pg_advisory_lock($1)", gate)
	granted := make(chan error, 1)
	go func() {
		_, err := other.Exec(context.Background(), "SELECT pg_advisory_lock($1)", turn)
		granted <- err
	}()
	return granted
}

// turnBegins fails the test unless the turn asked for begins within 30
// seconds.
func turnBegins(t *testing.T, granted <-chan error) {
	t.Helper()
	select {
	case err := <-granted:
		require.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Fatal("the turn did not begin once the tests under way ended")
	}
}

// startTest runs the subtest name of t in the background; the channel
// closes when it has ended.
func startTest(t *testing.T, name string, f func(t *testing.T)) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		t.Run(name, f)
	}()
	return done
}

// underWay starts a subtest that holds a share until release is called,
// and returns once it holds it.
func underWay(t *testing.T) (release func(), done <-chan struct{}) {
	running, end := make(chan struct{}), make(chan struct{})
	done = startTest(t, "under way", func(t *testing.T) {
		Shared(t)
		close(running)
		<-end
	})
	<-running
	return func() { close(end) }, done
}

// A test holds its share of the server until it ends: another process's
// turn cannot begin meanwhile.
func TestATurnWaitsForTheTestsUnderWay(t *testing.T) {
	turn, _ := privateLocks(t)
	other := otherProcess(t)
	t.Run("under way", func(t *testing.T) {
		Shared(t)
		assert.False(t, turnFree(t, other, turn), "a turn began while a test was under way")
	})
	assert.True(t, turnFree(t, other, turn), "the share is given back when the test ends")
}

// No test starts while another process holds its turn.
func TestNoTestStartsDuringATurn(t *testing.T) {
	turn, gate := privateLocks(t)
	other := otherProcess(t)
	execOn(t, other, "SELECT pg_advisory_lock($1)", gate)
	execOn(t, other, "SELECT pg_advisory_lock($1)", turn)
	started := make(chan struct{})
	done := startTest(t, "starting", func(t *testing.T) {
		Fresh(t)
		close(started)
	})
	waitForLockWait(t, other, turn, gate)
	select {
	case <-started:
		t.Fatal("a test started during another process's turn")
	default:
	}
	require.NoError(t, other.Close(context.Background())) // the turn ends
	within(t, done, "the test after the turn")
}

// A turn that another process asks for is not kept waiting by this
// process's tests overlapping: a test that starts once it has asked waits
// at the gate instead of joining the share of those under way.
func TestTheGateHoldsBackTestsOnceATurnIsAskedFor(t *testing.T) {
	turn, gate := privateLocks(t)
	other := otherProcess(t)
	release, firstDone := underWay(t)
	granted := askForTurn(t, other, turn, gate)
	secondDone := startTest(t, "second", func(t *testing.T) { Shared(t) })
	waitForLockWait(t, otherProcess(t), gate)
	release()
	within(t, firstDone, "the test under way")
	turnBegins(t, granted)
	select {
	case <-secondDone:
		t.Fatal("the second test started during the turn")
	default:
	}
	require.NoError(t, other.Close(context.Background()))
	within(t, secondDone, "the second test after the turn")
}

// A turn of this process begins beside its own tests under way (it gives
// up their share instead of waiting for it), lets its own tests start, and
// takes their share again when it ends.
func TestATurnOfThisProcess(t *testing.T) {
	turn, _ := privateLocks(t)
	other := otherProcess(t)
	release, underWayDone := underWay(t)
	turnDone := startTest(t, "turn", func(t *testing.T) {
		ServerWide(t)
		t.Run("inside", func(t *testing.T) { Fresh(t) })
	})
	within(t, turnDone, "the turn beside a test of its own process")
	// (Not turnFree: the turn's backend may still be on its way out,
	// holding the turn.)
	assert.True(t, shareHeld(t, other, turn), "the test still under way holds its share again")
	release()
	within(t, underWayDone, "the test under way")
	assert.True(t, turnFree(t, other, turn))
}

// A subtest shares its parent's share: one that starts once another
// process has asked for its turn does not wait at the gate for a turn that
// waits for its parent.
func TestSubtestsShareTheirParentsShare(t *testing.T) {
	turn, gate := privateLocks(t)
	other := otherProcess(t)
	var granted <-chan error
	t.Run("parent", func(t *testing.T) {
		Shared(t)
		granted = askForTurn(t, other, turn, gate)
		waitForLockWait(t, otherProcess(t), turn)
		within(t, startTest(t, "child", func(t *testing.T) { Shared(t) }), "a subtest while another process waits for its turn")
	})
	turnBegins(t, granted)
}

// The package database's idle connections close for a turn another
// process asks for (it waits for free connections, and counts them as
// used): when the last test under way ends, and when a test waits at the
// gate.
func TestIdleConnectionsCloseForATurn(t *testing.T) {
	turn, gate := privateLocks(t)
	other := otherProcess(t)
	db, err := sharedDB()
	require.NoError(t, err)
	release, done := underWay(t)
	granted := askForTurn(t, other, turn, gate)
	_, err = db.SQL.Exec("SELECT 1")
	require.NoError(t, err)
	require.Positive(t, db.Pool.Stat().TotalConns())
	release()
	within(t, done, "the test under way")
	assert.Zero(t, db.Pool.Stat().TotalConns(), "idle connections once the last test under way ended")

	turnBegins(t, granted)
	_, err = db.SQL.Exec("SELECT 1")
	require.NoError(t, err)
	require.Positive(t, db.Pool.Stat().TotalConns())
	waiting := startTest(t, "waiting", func(t *testing.T) { Shared(t) })
	waitForLockWait(t, otherProcess(t), gate)
	assert.Zero(t, db.Pool.Stat().TotalConns(), "idle connections while a test waits at the gate")
	require.NoError(t, other.Close(context.Background()))
	within(t, waiting, "the test after the turn")
}
