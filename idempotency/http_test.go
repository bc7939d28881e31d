package idempotency_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/idempotency"
	"github.com/pgsaga/pgsaga/internal/testdb"
)

// orderAPI is an HTTP handler that records each order it creates in the
// middleware's transaction and answers by the requested amount.
type orderAPI struct {
	table   string
	calls   atomic.Int32
	inside  chan struct{} // when set, closed on the first call's entry
	release chan struct{} // when set, the first call waits for it
	// refuse, when set, holds statuses to answer with, one per call, after
	// writing the order.
	refuse chan int
}

func (a *orderAPI) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if n := a.calls.Add(1); a.inside != nil && n == 1 {
		close(a.inside)
		<-a.release
	}
	var body struct{ Amount, Pad int }
	_ = json.NewDecoder(r.Body).Decode(&body)
	switch {
	case body.Amount >= 1_000_000:
		w.WriteHeader(http.StatusInternalServerError) // transient
		return
	}
	tx, ok := idempotency.TxFromContext(r.Context())
	if !ok {
		http.Error(w, "no transaction", http.StatusInternalServerError)
		return
	}
	id := uuid.NewString()
	if _, err := tx.ExecContext(r.Context(), `INSERT INTO `+a.table+` (id, amount) VALUES ($1, $2)`, id, body.Amount); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	select {
	case code := <-a.refuse:
		w.WriteHeader(code)
		return
	default:
	}
	if body.Amount <= 0 {
		// Refused after writing: the write must not survive.
		http.Error(w, "amount must be positive", http.StatusUnprocessableEntity)
		return
	}
	w.Header().Set("Location", "/orders/"+id)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%q,"amount":%d,"pad":%q}`, id, body.Amount, strings.Repeat("x", body.Pad))
}

type httpEnv struct {
	t     *testing.T
	db    *testdb.DB
	table string
	api   *orderAPI
	srv   *httptest.Server
	store *idempotency.Store
	cfg   idempotency.HTTPConfig // the middleware's
	ns    string                 // keeps this test's keys apart from other tests'
}

// httpSetup is what an httpEnv option may change before the server starts.
type httpSetup struct {
	cfg *idempotency.HTTPConfig
	api *orderAPI
	// handler replaces api behind the middleware when set.
	handler http.Handler
	// outer, when set, wraps the middleware.
	outer func(http.Handler) http.Handler
}

func newHTTPEnv(t *testing.T, required bool, opts ...func(*httpSetup)) *httpEnv {
	t.Helper()
	s, db := newStore(t, nil)
	table := "orders_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	_, err := db.SQL.Exec(`CREATE TABLE ` + table + ` (id text PRIMARY KEY, amount int)`)
	require.NoError(t, err)
	cfg := idempotency.HTTPConfig{
		Scope:    "POST /orders",
		Required: required,
		Caller: func(r *http.Request) (string, error) {
			if c := r.Header.Get("X-Client"); c != "" {
				return c, nil
			}
			return "", errors.New("anonymous")
		},
		MaxBodyBytes: 1024,
	}
	setup := httpSetup{cfg: &cfg, api: &orderAPI{table: table}}
	for _, o := range opts {
		o(&setup)
	}
	mw, err := s.HTTPMiddleware(cfg)
	require.NoError(t, err)
	var h http.Handler = setup.api
	if setup.handler != nil {
		h = setup.handler
	}
	h = mw(h)
	if setup.outer != nil {
		h = setup.outer(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return &httpEnv{t: t, db: db, table: table, api: setup.api, srv: srv, store: s, cfg: cfg, ns: uuid.NewString()[:8] + "-"}
}

type reply struct {
	code     int
	body     string
	location string
	replayed bool
}

func (e *httpEnv) post(client, key, body string) reply {
	e.t.Helper()
	return e.send(http.MethodPost, "/orders", client, key, body)
}

// send sends a request for target (path and query) with the namespaced key.
func (e *httpEnv) send(method, target, client, key, body string) reply {
	e.t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+target, strings.NewReader(body))
	require.NoError(e.t, err)
	if client != "" {
		req.Header.Set("X-Client", client)
	}
	if key != "" {
		req.Header.Set(idempotency.KeyHeader, e.ns+key)
	}
	return e.do(req)
}

// do sends req as it is.
func (e *httpEnv) do(req *http.Request) reply {
	e.t.Helper()
	resp, err := http.DefaultClient.Do(req)
	require.NoError(e.t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(e.t, err)
	return reply{code: resp.StatusCode, body: string(b), location: resp.Header.Get("Location"), replayed: resp.Header.Get(idempotency.ReplayedHeader) == "true"}
}

func TestHTTPReplaysFinishedRequest(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	first := e.post("alice", "k1", `{"amount":100}`)
	require.Equal(t, http.StatusCreated, first.code, first.body)
	assert.False(t, first.replayed)
	second := e.post("alice", "k1", `{"amount":100}`)
	assert.Equal(t, first.code, second.code)
	assert.Equal(t, first.body, second.body)
	assert.Equal(t, first.location, second.location, "headers are replayed")
	assert.True(t, second.replayed, "Idempotent-Replayed: true")
	assert.EqualValues(t, 1, e.api.calls.Load())
}

func TestHTTPMissingKey(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	r := e.post("alice", "", `{"amount":100}`)
	assert.Equal(t, http.StatusBadRequest, r.code)
	assert.Contains(t, r.body, "Idempotency-Key")
	assert.Zero(t, e.api.calls.Load())

	optional := newHTTPEnv(t, false)
	r = optional.post("alice", "", `{"amount":100}`)
	assert.Equal(t, http.StatusInternalServerError, r.code, "without a key the handler runs unprotected, with no transaction")
	assert.EqualValues(t, 1, optional.api.calls.Load())
}

func TestHTTPKeyReusedWithDifferentBody(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	require.Equal(t, http.StatusCreated, e.post("alice", "k1", `{"amount":100}`).code)
	r := e.post("alice", "k1", `{"amount":999}`)
	assert.Equal(t, http.StatusUnprocessableEntity, r.code)
	assert.EqualValues(t, 1, e.api.calls.Load())
}

// A key names one request: method, path, query and body. The same key with
// another method or query is a different request, refused like another
// body, never answered with the first one's response.
func TestHTTPKeyReusedWithDifferentMethodOrQuery(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	require.Equal(t, http.StatusCreated, e.send(http.MethodPost, "/orders?priority=low", "alice", "k1", `{"amount":100}`).code)
	for _, c := range []struct{ method, target string }{
		{http.MethodPut, "/orders?priority=low"},
		{http.MethodPost, "/orders?priority=high"},
		{http.MethodPost, "/orders"},
		{http.MethodPost, "/orders/"},
	} {
		r := e.send(c.method, c.target, "alice", "k1", `{"amount":100}`)
		assert.Equal(t, http.StatusUnprocessableEntity, r.code, "%s %s", c.method, c.target)
	}
	assert.EqualValues(t, 1, e.api.calls.Load())
	r := e.send(http.MethodPost, "/orders?priority=low", "alice", "k1", `{"amount":100}`)
	assert.Equal(t, http.StatusCreated, r.code)
	assert.True(t, r.replayed, "the same request is replayed")
}

// A key that PostgreSQL cannot store as text (not UTF-8) is the client's
// mistake: 400 with the reason, before anything is claimed, so a client
// does not retry it forever as it would a 500.
func TestHTTPKeyMustBeUTF8(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	r := e.post("alice", "bad-\xff\xfe-key", `{"amount":100}`)
	assert.Equal(t, http.StatusBadRequest, r.code)
	assert.Contains(t, r.body, "UTF-8")
	assert.EqualValues(t, 0, e.api.calls.Load())
}

func TestHTTPConcurrentSameKeyConflicts(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	e.api.inside, e.api.release = make(chan struct{}), make(chan struct{})
	first := make(chan reply, 1)
	go func() { first <- e.post("alice", "k1", `{"amount":100}`) }()
	<-e.api.inside
	r := e.post("alice", "k1", `{"amount":100}`)
	assert.Equal(t, http.StatusConflict, r.code)
	close(e.api.release)
	assert.Equal(t, http.StatusCreated, (<-first).code)
	assert.EqualValues(t, 1, e.api.calls.Load())
}

func TestHTTPKeysAreScopedByCaller(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	a := e.post("alice", "shared-key", `{"amount":100}`)
	b := e.post("bob", "shared-key", `{"amount":100}`)
	require.Equal(t, http.StatusCreated, a.code)
	require.Equal(t, http.StatusCreated, b.code)
	assert.False(t, b.replayed, "bob never sees alice's response")
	assert.NotEqual(t, a.location, b.location)
	assert.Equal(t, http.StatusUnauthorized, e.post("", "k", `{"amount":1}`).code)
}

func TestHTTPOutcomeKinds(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, true)
	// A final 4xx is stored and replayed.
	r1 := e.post("alice", "bad", `{"amount":0}`)
	r2 := e.post("alice", "bad", `{"amount":0}`)
	assert.Equal(t, http.StatusUnprocessableEntity, r1.code)
	assert.Equal(t, r1.code, r2.code)
	assert.True(t, r2.replayed)
	assert.Zero(t, count(t, e.db, `SELECT count(*) FROM `+e.table+` WHERE amount <= 0`), "a refusal keeps none of its writes")
	// A 5xx is transient: not stored, the retry runs the handler again.
	before := e.api.calls.Load()
	assert.Equal(t, http.StatusInternalServerError, e.post("alice", "flaky", `{"amount":1000000}`).code)
	r3 := e.post("alice", "flaky", `{"amount":1000000}`)
	assert.False(t, r3.replayed)
	assert.Equal(t, before+2, e.api.calls.Load())
	// Oversized bodies are refused before anything is claimed.
	assert.Equal(t, http.StatusRequestEntityTooLarge, e.post("alice", "big", `{"amount":1,"pad":"`+strings.Repeat("x", 2000)+`"}`).code)
}

func TestHTTPMiddlewareConfig(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, nil)
	_, err := s.HTTPMiddleware(idempotency.HTTPConfig{Scope: "x"})
	require.ErrorIs(t, err, idempotency.ErrInvalidRequest, "a caller function is required")
	_, err = s.HTTPMiddleware(idempotency.HTTPConfig{Caller: func(*http.Request) (string, error) { return "a", nil }})
	require.ErrorIs(t, err, idempotency.ErrInvalidRequest, "a scope is required")
}
