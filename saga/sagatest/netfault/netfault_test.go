package netfault_test

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/saga/sagatest/netfault"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// link is a link to the test's database and its URL through it.
func link(t *testing.T) (*netfault.Link, string) {
	t.Helper()
	return netfault.Through(t, testdb.Shared(t).URL)
}

func connect(ctx context.Context, t *testing.T, url string) (*pgx.Conn, error) {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	if err == nil {
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
	}
	return conn, err
}

// Through a link with latency, a round trip takes at least the latency
// each way.
func TestLatencyDelaysEachWay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, through := link(t)
	conn, err := connect(ctx, t, through)
	require.NoError(t, err)
	require.NoError(t, l.Latency(15*time.Millisecond, 5*time.Millisecond))
	start := time.Now()
	_, err = conn.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "two ways of at least 10 ms")
	assert.ErrorIs(t, l.Latency(-time.Millisecond, 0), netfault.ErrInvalidFault)
}

// A reset cuts a connection mid-stream: its next statement fails with the
// connection; once healed, a new one works.
func TestResetCutsAConnectionMidStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, through := link(t)
	conn, err := connect(ctx, t, through)
	require.NoError(t, err)
	require.NoError(t, l.Reset(1))
	_, err = conn.Exec(ctx, `SELECT 1`)
	require.Error(t, err)
	assert.True(t, conn.IsClosed(), "the connection is gone: %v", err)
	l.Heal()
	again, err := connect(ctx, t, through)
	require.NoError(t, err)
	_, err = again.Exec(ctx, `SELECT 1`)
	require.NoError(t, err)
	assert.ErrorIs(t, l.Reset(1.5), netfault.ErrInvalidFault)
}

// During a partition nothing answers: a statement waits until its context
// ends, and a connection cannot be opened. It heals on its own once its
// time is up: a new connection works.
func TestAPartitionHealsOnItsOwn(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, through := link(t)
	conn, err := connect(ctx, t, through)
	require.NoError(t, err)
	require.NoError(t, l.Partition(2*time.Second))
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = conn.Exec(short, `SELECT 1`)
	require.Error(t, err, "nothing answers during the partition")
	short2, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel2()
	_, err = connect(short2, t, through)
	require.Error(t, err, "no connection opens during the partition")
	require.Eventually(t, func() bool {
		c, err := connect(ctx, t, through)
		return err == nil && c.Ping(ctx) == nil
	}, 10*time.Second, 50*time.Millisecond, "healed after its time")
}

// URL puts the link's address in a URL of one host.
func TestURL(t *testing.T) {
	t.Parallel()
	l := netfault.New(t, "127.0.0.1:1")
	u, err := l.URL("postgres://u:p@db.example:5432/app?sslmode=disable")
	require.NoError(t, err)
	assert.Equal(t, "postgres://u:p@"+l.Addr()+"/app?sslmode=disable", u)
	_, err = l.URL("postgres:///app?host=/tmp")
	assert.Error(t, err)
}

// Faults changed from many goroutines at once take turns: none fails.
func TestFaultsChangeConcurrently(t *testing.T) {
	t.Parallel()
	l := netfault.New(t, "127.0.0.1:1")
	errs := make(chan error, 60)
	var wg sync.WaitGroup
	for i := range 60 {
		wg.Go(func() {
			switch i % 3 {
			case 0:
				errs <- l.Latency(time.Millisecond, 0)
			case 1:
				errs <- l.Reset(0.5)
			default:
				l.Heal()
				errs <- nil
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
}

// A partition that replaces a shorter one is not healed by the shorter
// one's end.
func TestALaterPartitionOutlastsAnEarlierOnesEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	l, through := link(t)
	require.NoError(t, l.Partition(time.Millisecond))
	require.NoError(t, l.Partition(time.Minute))
	time.Sleep(50 * time.Millisecond) // past the first one's end: the scenario, not a wait for a result
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err := connect(short, t, through)
	require.Error(t, err, "still cut")
	l.Heal()
	_, err = connect(ctx, t, through)
	require.NoError(t, err, "healed")
}

// Faults that cannot be are refused, as ErrInvalidFault.
func TestInvalidFaults(t *testing.T) {
	t.Parallel()
	l := netfault.New(t, "127.0.0.1:1")
	for name, err := range map[string]error{
		"negative latency":    l.Latency(-time.Millisecond, 0),
		"under a millisecond": l.Latency(500*time.Microsecond, 0),
		"jitter over latency": l.Latency(time.Millisecond, 2*time.Millisecond),
		"no bandwidth":        l.Bandwidth(0),
		"NaN toxicity":        l.Reset(math.NaN()),
		"toxicity over 1":     l.Reset(1.5),
		"no partition":        l.Partition(0),
	} {
		assert.ErrorIs(t, err, netfault.ErrInvalidFault, name)
	}
	_, err := l.URL("postgres://u@localhost/db")
	assert.Error(t, err, "a URL without a port")
}
