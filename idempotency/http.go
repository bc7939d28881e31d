package idempotency

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/pgsaga/pgsaga/internal/dbtx"
)

// HTTP header names the HTTP middleware uses.
const (
	// KeyHeader carries the client's idempotency key.
	KeyHeader = "Idempotency-Key"
	// ReplayedHeader is "true" on a response replayed from the store.
	ReplayedHeader = "Idempotent-Replayed"
)

// HTTPConfig configures Store.HTTPMiddleware.
type HTTPConfig struct {
	// Scope names the endpoint. Required, at most 100 bytes.
	Scope string
	// Caller identifies who sent the request (an account, an API client).
	// Keys are scoped by it: a key one caller sent never replays another
	// caller's response. An error answers 401. Required.
	Caller func(*http.Request) (string, error)
	// Required answers 400 to a request without an Idempotency-Key.
	// Otherwise such requests pass through unprotected.
	Required bool
	// MaxBodyBytes bounds the request body, which is read in full to
	// fingerprint the request; larger bodies answer 413. Default: 1 MiB.
	MaxBodyBytes int64
	// LockTimeout is how long a request waits for a concurrent request with
	// the same key to finish (and then replays its response) before it
	// answers 409. Default: 0, answer 409 at once.
	LockTimeout time.Duration
}

type httpTxKey struct{}

// TxFromContext returns the transaction an HTTP handler behind the
// middleware runs in: writes made through it commit with the stored response,
// or not at all.
func TxFromContext(ctx context.Context) (dbtx.DBTX, bool) {
	tx, ok := ctx.Value(httpTxKey{}).(dbtx.DBTX)
	return tx, ok
}

// httpMeta is what a stored HTTP response keeps besides status and body.
type httpMeta struct {
	Header http.Header `json:"header,omitempty"`
}

// HTTPMiddleware makes a net/http handler run at most once per
// (caller, Idempotency-Key). The handler runs inside a READ COMMITTED
// transaction that holds the claim (see TxFromContext), and its response is
// buffered until the claim and the handler's writes have committed.
//
//   - no key: 400 if Required, else the request passes through;
//   - the same key while the first request runs: 409;
//   - the same key with a different method, path, query or body: 422;
//   - the same key after the first request finished: its status, headers and
//     body, with Idempotent-Replayed: true.
//
// Responses 2xx-4xx are stored; a 4xx as failed, without the handler's
// writes. 5xx, 408 and 429 are transient: nothing is stored, and the client
// may retry with the same key.
func (s *Store) HTTPMiddleware(cfg HTTPConfig) (func(http.Handler) http.Handler, error) {
	if cfg.Scope == "" || len(cfg.Scope) > 100 {
		return nil, fmt.Errorf("%w: HTTP scope must be 1 to 100 bytes", ErrInvalidRequest)
	}
	if cfg.Caller == nil {
		return nil, fmt.Errorf("%w: HTTPConfig.Caller is required: keys must be scoped by caller", ErrInvalidRequest)
	}
	if s.cfg.DB == nil {
		return nil, errors.New("idempotency: Config.DB is required for the HTTP middleware")
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = 1 << 20
	}
	lockTimeout := strconv.FormatInt(max(cfg.LockTimeout.Milliseconds(), 1), 10)
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.serveHTTP(cfg, lockTimeout, next, w, r)
		})
	}, nil
}

func (s *Store) serveHTTP(cfg HTTPConfig, lockTimeout string, next http.Handler, w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get(KeyHeader)
	if key == "" {
		if cfg.Required {
			httpError(w, http.StatusBadRequest, "missing "+KeyHeader+" header")
			return
		}
		next.ServeHTTP(w, r)
		return
	}
	if len(key) > MaxKeyLen {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("%s longer than %d bytes", KeyHeader, MaxKeyLen))
		return
	}
	if !storableText(key) {
		httpError(w, http.StatusBadRequest, KeyHeader+" must be UTF-8 text")
		return
	}
	caller, err := cfg.Caller(r)
	if err != nil || caller == "" {
		httpError(w, http.StatusUnauthorized, "caller not identified")
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, cfg.MaxBodyBytes))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			httpError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body larger than %d bytes", cfg.MaxBodyBytes))
			return
		}
		httpError(w, http.StatusBadRequest, "reading request body: "+err.Error())
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	callerHash := sha256.Sum256([]byte(caller))
	req := Request{
		Scope: "http:" + cfg.Scope + ":" + hex.EncodeToString(callerHash[:16]),
		Key:   key,
		Hash:  Fingerprint([]byte(r.Method), []byte(r.URL.Path), []byte(r.URL.RawQuery), body),
	}

	ctx := r.Context()
	tx, err := s.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		s.cfg.Logger.Error("idempotency: beginning transaction", "err", err)
		httpError(w, http.StatusServiceUnavailable, "database unavailable")
		return
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit

	claim, err := s.claimTx(ctx, tx, req, lockTimeout)
	switch {
	case errors.Is(err, ErrInProgress):
		w.Header().Set("Retry-After", "1")
		httpError(w, http.StatusConflict, "a request with this "+KeyHeader+" is in progress")
		return
	case errors.Is(err, ErrKeyReused):
		httpError(w, http.StatusUnprocessableEntity, KeyHeader+" was already used with a different request")
		return
	case err != nil:
		s.cfg.Logger.Error("idempotency: claiming HTTP request", "scope", req.Scope, "err", err)
		httpError(w, http.StatusInternalServerError, "could not claim the request")
		return
	}
	if !claim.Execute {
		if err := tx.Commit(); err != nil {
			httpError(w, http.StatusInternalServerError, "could not read the stored response")
			return
		}
		writeStored(w, claim.Record.Response)
		return
	}

	if _, err := tx.ExecContext(ctx, savepointSQL); err != nil {
		httpError(w, http.StatusInternalServerError, "could not start the request")
		return
	}
	rec := &recorder{header: http.Header{}, code: http.StatusOK}
	next.ServeHTTP(rec, r.WithContext(context.WithValue(ctx, httpTxKey{}, dbtx.DBTX(tx))))
	if transientStatus(rec.code) {
		_ = tx.Rollback()
		rec.writeTo(w)
		return
	}
	status := StatusCompleted
	if rec.code >= 400 {
		// A refusal is stored without the writes that led to it.
		status = StatusFailed
		if _, err := tx.ExecContext(ctx, rollbackToSavepointSQL); err != nil {
			httpError(w, http.StatusInternalServerError, "could not discard the request's writes")
			return
		}
	}
	header := rec.header.Clone()
	header.Del("Date")
	header.Del("Content-Length")
	meta, _ := json.Marshal(httpMeta{Header: header})
	if err := s.CompleteTx(ctx, tx, req, status, Response{Code: rec.code, Body: rec.body.Bytes(), Meta: meta}); err != nil {
		s.cfg.Logger.Error("idempotency: storing HTTP response", "scope", req.Scope, "err", err)
		httpError(w, http.StatusInternalServerError, "could not store the response")
		return
	}
	if err := tx.Commit(); err != nil {
		s.cfg.Logger.Error("idempotency: committing HTTP request", "scope", req.Scope, "err", err)
		httpError(w, http.StatusInternalServerError, "could not commit the request")
		return
	}
	rec.writeTo(w)
}

func transientStatus(code int) bool {
	return code >= 500 || code == http.StatusRequestTimeout || code == http.StatusTooManyRequests
}

func writeStored(w http.ResponseWriter, resp Response) {
	var meta httpMeta
	_ = json.Unmarshal(resp.Meta, &meta)
	for k, vs := range meta.Header {
		for _, v := range vs {
			w.Header().Add(k, v)
		}
	}
	w.Header().Set(ReplayedHeader, "true")
	w.WriteHeader(resp.Code)
	_, _ = w.Write(resp.Body)
}

func httpError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// recorder buffers a handler's response until its outcome is stored.
type recorder struct {
	header      http.Header
	code        int
	wroteHeader bool
	body        bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if !r.wroteHeader {
		r.code, r.wroteHeader = code, true
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.wroteHeader = true
	return r.body.Write(b)
}

func (r *recorder) writeTo(w http.ResponseWriter) {
	for k, vs := range r.header {
		w.Header()[k] = vs
	}
	w.WriteHeader(r.code)
	_, _ = w.Write(r.body.Bytes())
}
