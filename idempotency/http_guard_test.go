package idempotency_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
)

// The claim's short lock_timeout bounds the wait for a concurrent request
// with the same key, not the handler's own statements: a handler whose
// UPDATE waits on a row another transaction holds waits for it, and answers.
func TestHTTPHandlerLockWaitIsNotBoundByClaim(t *testing.T) {
	t.Parallel()
	var (
		table   string
		started = make(chan struct{})
	)
	e := newHTTPEnv(t, true, func(s *httpSetup) {
		table = s.api.table
		s.handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			close(started)
			tx, _ := idempotency.TxFromContext(r.Context())
			if _, err := tx.ExecContext(r.Context(), `UPDATE `+table+` SET amount = amount + 1 WHERE id = 'held'`); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.WriteHeader(http.StatusOK)
		})
	})
	_, err := e.db.SQL.Exec(`INSERT INTO ` + table + ` (id, amount) VALUES ('held', 0)`)
	require.NoError(t, err)
	holder, err := e.db.SQL.Begin()
	require.NoError(t, err)
	defer holder.Rollback() //nolint:errcheck
	_, err = holder.Exec(`UPDATE ` + table + ` SET amount = amount WHERE id = 'held'`)
	require.NoError(t, err)

	answer := make(chan reply, 1)
	go func() { answer <- e.post("alice", "k1", `{"amount":1}`) }()
	<-started
	// Release the row once the handler's UPDATE waits for it (or the
	// handler has answered without waiting).
	var r reply
	deadline := time.Now().Add(10 * time.Second)
wait:
	for {
		select {
		case r = <-answer:
			break wait
		default:
		}
		if count(t, e.db, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE `+table+`%'`) > 0 {
			require.NoError(t, holder.Commit())
			r = <-answer
			break wait
		}
		require.True(t, time.Now().Before(deadline), "the handler's UPDATE never waited")
		time.Sleep(5 * time.Millisecond)
	}
	assert.Equal(t, http.StatusOK, r.code, r.body)
	assert.Equal(t, 1, count(t, e.db, `SELECT amount FROM `+table+` WHERE id = 'held'`))
}

// A client that gives up while the handler runs does not undo it: the
// handler finishes and commits, and the client's retry with the same key
// gets the stored response instead of running the handler again.
func TestHTTPClientGoneHandlerRunsOnce(t *testing.T) {
	t.Parallel()
	serverCtx := make(chan context.Context, 1)
	e := newHTTPEnv(t, true, func(s *httpSetup) {
		s.api.inside, s.api.release = make(chan struct{}), make(chan struct{})
		s.outer = func(h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				select {
				case serverCtx <- r.Context():
				default:
				}
				h.ServeHTTP(w, r)
			})
		}
	})
	ctx, cancel := context.WithCancel(context.Background())
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+"/orders", strings.NewReader(`{"amount":100}`))
	require.NoError(t, err)
	req.Header.Set("X-Client", "alice")
	req.Header.Set(idempotency.KeyHeader, e.ns+"k1")
	gone := make(chan error, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		gone <- err
	}()
	<-e.api.inside
	cancel()
	require.ErrorIs(t, <-gone, context.Canceled)
	select {
	case <-(<-serverCtx).Done(): // the server saw the client leave
	case <-time.After(10 * time.Second):
		t.Fatal("the server never noticed the client left")
	}
	close(e.api.release)

	var r reply
	deadline := time.Now().Add(10 * time.Second)
	for {
		r = e.post("alice", "k1", `{"amount":100}`)
		if r.code != http.StatusConflict {
			break
		}
		require.True(t, time.Now().Before(deadline), "the first request never finished")
		time.Sleep(5 * time.Millisecond)
	}
	assert.Equal(t, http.StatusCreated, r.code, r.body)
	assert.True(t, r.replayed)
	assert.EqualValues(t, 1, e.api.calls.Load(), "the handler ran once")
	assert.Equal(t, 1, count(t, e.db, `SELECT count(*) FROM `+e.table))
}

// Answers that say "not now" or "not you" are not the request's outcome: the
// key is released, with none of the handler's writes, and a retry runs the
// handler again.
func TestHTTPRetryableRefusalsAreNotStored(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true, func(s *httpSetup) { s.api.refuse = make(chan int, 1) })
	codes := []int{
		http.StatusUnauthorized, http.StatusForbidden, http.StatusRequestTimeout, http.StatusConflict,
		http.StatusLocked, http.StatusTooEarly, http.StatusTooManyRequests, http.StatusServiceUnavailable,
	}
	for _, code := range codes {
		key := "k" + http.StatusText(code)
		e.api.refuse <- code
		first := e.post("alice", key, `{"amount":100}`)
		require.Equal(t, code, first.code)
		second := e.post("alice", key, `{"amount":100}`)
		assert.Equal(t, http.StatusCreated, second.code, "after a %d the retry runs the handler", code)
		assert.False(t, second.replayed)
	}
	assert.EqualValues(t, 2*len(codes), e.api.calls.Load())
	assert.Equal(t, len(codes), count(t, e.db, `SELECT count(*) FROM `+e.table), "the refusals' writes are discarded")
}

// A request with two Idempotency-Key fields is ambiguous: 400, whichever
// comes first.
func TestHTTPTwoKeysAreRefused(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/orders", strings.NewReader(`{"amount":100}`))
	require.NoError(t, err)
	req.Header.Set("X-Client", "alice")
	req.Header.Add(idempotency.KeyHeader, e.ns+"k1")
	req.Header.Add(idempotency.KeyHeader, e.ns+"k2")
	r := e.do(req)
	assert.Equal(t, http.StatusBadRequest, r.code)
	assert.Contains(t, r.body, "one "+idempotency.KeyHeader)
	assert.Zero(t, e.api.calls.Load())
}

// postKey sends a POST with the key header exactly as given.
func (e *httpEnv) postKey(header, body string) reply {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/orders", strings.NewReader(body))
	require.NoError(e.t, err)
	req.Header.Set("X-Client", "alice")
	req.Header.Set(idempotency.KeyHeader, header)
	return e.do(req)
}

// The key is a structured-field string (draft-ietf-httpapi-idempotency-key-header):
// quoted, with \" and \\ escapes. The quotes are not part of the key, so a
// client that sends the key bare (accepted for compatibility) and then quoted
// gets its first response.
func TestHTTPKeyIsStructuredFieldString(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	first := e.postKey(`"`+e.ns+`k1"`, `{"amount":100}`)
	require.Equal(t, http.StatusCreated, first.code, first.body)
	bare := e.postKey(e.ns+"k1", `{"amount":100}`)
	assert.True(t, bare.replayed, "the quotes are not part of the key")
	assert.Equal(t, first.body, bare.body)
	assert.Equal(t, 1, count(t, e.db, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, e.ns+"k1"))

	escaped := e.postKey(`"`+e.ns+`a\"b\\c"`, `{"amount":100}`)
	require.Equal(t, http.StatusCreated, escaped.code, escaped.body)
	assert.Equal(t, 1, count(t, e.db, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, e.ns+`a"b\c`))

	for _, bad := range []string{
		`"` + e.ns + `unterminated`,
		`"` + e.ns + `bad\qescape"`,
		`"` + e.ns + "tab\there" + `"`,
		`"` + e.ns + `näive"`,
		`"` + e.ns + `k2" trailing`,
		`"` + e.ns + `k2";p=1`,
		`"` + e.ns + `k2", "` + e.ns + `k3"`,
		`""`,
	} {
		r := e.postKey(bad, `{"amount":100}`)
		assert.Equal(t, http.StatusBadRequest, r.code, "%q", bad)
		assert.Contains(t, r.body, "structured-field string", "%q", bad)
		for _, echo := range []string{`\q`, "ä", "trailing", "p=1", e.ns} {
			assert.NotContains(t, r.body, echo, "the message never echoes the key")
		}
	}
	assert.EqualValues(t, 2, e.api.calls.Load())
}

// A response too large to keep for replay is not sent half-stored: the
// request fails with 500, its writes are rolled back and the key released.
func TestHTTPResponseLargerThanMaxFails(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	big := `{"amount":100,"pad":` + strconv.Itoa(1<<20+1) + `}`
	for range 2 {
		r := e.post("alice", "big", big)
		assert.Equal(t, http.StatusInternalServerError, r.code)
		assert.False(t, r.replayed)
		assert.Less(t, len(r.body), 1<<10, "none of the oversized body is sent")
	}
	assert.EqualValues(t, 2, e.api.calls.Load(), "the key is released: the retry runs the handler")
	assert.Zero(t, count(t, e.db, `SELECT count(*) FROM `+e.table), "the writes are rolled back")
	assert.Zero(t, count(t, e.db, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, e.ns+"big"))

	small := newHTTPEnv(t, true, func(s *httpSetup) { s.cfg.MaxResponseBytes = 256 })
	assert.Equal(t, http.StatusInternalServerError, small.post("alice", "k1", `{"amount":100,"pad":300}`).code)
	assert.Equal(t, http.StatusCreated, small.post("alice", "k2", `{"amount":100,"pad":100}`).code)
}

// HandlerTimeout bounds the handler and its transaction: past it the
// request rolls back and the key is released.
func TestHTTPHandlerTimeout(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	cfg := e.cfg
	cfg.HandlerTimeout = 300 * time.Millisecond
	mw, err := e.store.HTTPMiddleware(cfg)
	require.NoError(t, err)
	slow := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // the deadline: nobody cancels the request
		e.api.ServeHTTP(w, r)
	})))
	t.Cleanup(slow.Close)
	req, err := http.NewRequest(http.MethodPost, slow.URL+"/orders", strings.NewReader(`{"amount":100}`))
	require.NoError(t, err)
	req.Header.Set("X-Client", "alice")
	req.Header.Set(idempotency.KeyHeader, e.ns+"k1")
	r := e.do(req)
	assert.GreaterOrEqual(t, r.code, http.StatusInternalServerError, r.body)

	// Retried without a deadline, on the same store and scope. database/sql
	// rolls back a transaction whose context ended on a goroutine of its
	// own: the key is released just after the answer.
	deadline := time.Now().Add(10 * time.Second)
	for r = e.post("alice", "k1", `{"amount":100}`); r.code == http.StatusConflict; r = e.post("alice", "k1", `{"amount":100}`) {
		require.True(t, time.Now().Before(deadline), "the key was never released")
		time.Sleep(5 * time.Millisecond)
	}
	assert.Equal(t, http.StatusCreated, r.code, "the key was released")
	assert.False(t, r.replayed)
	assert.Equal(t, 1, count(t, e.db, `SELECT count(*) FROM `+e.table))
}

func TestParseKey(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		`"8e03978e-40d5-43e8-bc93-6894a57f9324"`: "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`8e03978e-40d5-43e8-bc93-6894a57f9324`:   "8e03978e-40d5-43e8-bc93-6894a57f9324",
		`"a b~!"`:                                "a b~!",
		`"\\"`:                                   `\`,
		`"\""`:                                   `"`,
	} {
		got, err := idempotency.ParseKey(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{``, `""`, `"`, `"a`, `"a\"`, `"a\b"`, `"a"b"`, `"a";x`, "\"\x7f\"", "\"\x1f\"", "\"\xc3\xa4\""} {
		_, err := idempotency.ParseKey(in)
		assert.ErrorIs(t, err, idempotency.ErrInvalidKey, "%q", in)
	}
}
