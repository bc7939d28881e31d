package fakegateway_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/payments/fakegateway"
)

func TestMain(m *testing.M) { testpg.Main(m) }

func post(t *testing.T, client *http.Client, url, key string, cents int64) (int, string, error) {
	t.Helper()
	return postCtx(context.Background(), client, url, key, cents)
}

// postCtx is post, given up when ctx ends. It may run on any goroutine.
func postCtx(ctx context.Context, client *http.Client, url, key string, cents int64) (int, string, error) {
	body, _ := json.Marshal(map[string]any{"account_id": "a1", "amount_cents": cents})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/charges", bytes.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var out struct{ ID string }
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out.ID, nil
}

// Concurrent calls with one key charge once and all get the same id.
func TestConcurrentCallsWithOneKeyChargeOnce(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	g, err := fakegateway.Start(context.Background(), fakegateway.Config{DB: db.SQL})
	require.NoError(t, err)
	defer g.Close()
	key := uuid.NewString()
	var wg sync.WaitGroup
	ids := make([]string, 12)
	for i := range ids {
		wg.Go(func() {
			code, id, err := post(t, http.DefaultClient, g.URL(), key, 500)
			assert.NoError(t, err)
			assert.Equal(t, http.StatusOK, code)
			ids[i] = id
		})
	}
	wg.Wait()
	for _, id := range ids {
		assert.Equal(t, ids[0], id)
	}
	op, ok, err := g.Operation(context.Background(), key)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, 12, op.Calls)
	assert.Equal(t, "succeeded", op.Outcome)
}

// A Lost call charges, then never answers; asking again with the key gets
// the charge.
func TestLostResponse(t *testing.T) {
	t.Parallel()
	db := testdb.Shared(t)
	key := uuid.NewString()
	g, err := fakegateway.Start(context.Background(), fakegateway.Config{DB: db.SQL, LostHang: time.Minute,
		Faults: func(c fakegateway.Call) fakegateway.Fault {
			if c.Attempt == 1 {
				return fakegateway.Lost
			}
			return fakegateway.None
		}})
	require.NoError(t, err)
	defer g.Close()
	// The client gives up once the charge has happened, however long the
	// gateway took to get there: no client timeout to race on a busy
	// machine.
	ctx, giveUp := context.WithCancel(context.Background())
	defer giveUp()
	answer := make(chan error, 1)
	go func() {
		_, _, err := postCtx(ctx, http.DefaultClient, g.URL(), key, 100)
		answer <- err
	}()
	var op fakegateway.Operation
	for deadline := time.Now().Add(30 * time.Second); ; {
		var ok bool
		op, ok, err = g.Operation(context.Background(), key)
		require.NoError(t, err)
		if ok {
			break
		}
		require.True(t, time.Now().Before(deadline), "the charge never happened")
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-answer:
		t.Fatalf("the gateway answered a lost call: %v", err)
	default:
	}
	giveUp()
	require.Error(t, <-answer, "the answer is lost")
	code, id, err := post(t, http.DefaultClient, g.URL(), key, 100)
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, code)
	assert.Equal(t, op.ID, id)
	stats, err := g.Stats(context.Background())
	require.NoError(t, err)
	assert.GreaterOrEqual(t, stats.Faults[fakegateway.Lost], 1)
}

func TestRandomFaultsAreReproducible(t *testing.T) {
	t.Parallel()
	run := func() []fakegateway.Fault {
		f := fakegateway.RandomFaults(42, 0.5)
		out := make([]fakegateway.Fault, 200)
		for i := range out {
			out[i] = f(fakegateway.Call{})
		}
		return out
	}
	a, b := run(), run()
	assert.Equal(t, a, b)
	faults := 0
	for _, f := range a {
		if f != fakegateway.None {
			faults++
		}
	}
	assert.InDelta(t, 100, faults, 30)
}
