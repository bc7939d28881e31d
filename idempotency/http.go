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
	"strings"
	"time"

	"github.com/pgsaga/pgsaga/saga/delivery"
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
	// answers 409. It bounds the claim only, not the handler's statements,
	// which wait as the database's lock_timeout says. Default: 0, answer
	// 409 at once.
	LockTimeout time.Duration
	// MaxResponseBytes bounds the response body buffered for the client and
	// kept for replay. A handler that writes more gets ErrResponseTooLarge
	// from Write; the request then answers 500, its writes are rolled back
	// and the key is released. Default: MaxResponseBytesDefault.
	MaxResponseBytes int64
	// HandlerTimeout bounds the handler and its transaction, from the claim
	// to the commit. The client leaving does not cancel them (see
	// HTTPMiddleware); this deadline does: the request answers as its
	// handler does (a 5xx, typically), the transaction is rolled back and
	// the key released. database/sql rolls back a transaction whose context
	// ended on a goroutine of its own, so a retry sent at once may still
	// get 409 for a moment. Default: 0, no deadline.
	HandlerTimeout time.Duration
}

// MaxResponseBytesDefault is the default HTTPConfig.MaxResponseBytes.
const MaxResponseBytesDefault = 1 << 20

type httpTxKey struct{}

// TxFromContext returns the transaction an HTTP handler behind the
// middleware runs in: writes made through it commit with the stored response,
// or not at all.
func TxFromContext(ctx context.Context) (delivery.DBTX, bool) {
	tx, ok := ctx.Value(httpTxKey{}).(delivery.DBTX)
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
// The key is a structured-field string, as draft-ietf-httpapi-idempotency-key-header
// has it: Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324" (see
// ParseKey). A bare value without quotes is accepted as the key itself, for
// clients written before; the quotes are not part of the key, so both forms
// name the same one.
//
//   - no key: 400 if Required, else the request passes through;
//   - more than one Idempotency-Key field, or a key that is not a valid
//     structured-field string: 400;
//   - the same key while the first request runs: 409;
//   - the same key with a different method, path, query or body: 422;
//   - the same key after the first request finished: its status, headers and
//     body, with Idempotent-Replayed: true.
//
// Once the key is claimed, the handler and its transaction run on a context
// that keeps the request's values but not its cancellation: a client that
// gives up (a timeout, a closed connection) does not roll the handler back,
// and its retry with the same key gets 409 while the handler runs, then the
// stored response. HTTPConfig.HandlerTimeout bounds them instead.
//
// Responses 2xx-4xx are stored; a 4xx as failed, without the handler's
// writes. Answers that are not the request's outcome but say "not now" or
// "not you" are not stored, and neither are the handler's writes: the key
// is released and the client may retry with it. Those are 5xx, 401
// Unauthorized and 403 Forbidden (credentials or grants may change), 408
// Request Timeout, 409 Conflict, 423 Locked, 425 Too Early and 429 Too Many
// Requests. A response body larger than HTTPConfig.MaxResponseBytes is
// neither stored nor sent: the request answers 500, rolled back, and the
// key is released.
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
	if cfg.MaxResponseBytes < 0 || cfg.HandlerTimeout < 0 {
		return nil, fmt.Errorf("%w: HTTPConfig.MaxResponseBytes and HandlerTimeout must not be negative", ErrInvalidRequest)
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = 1 << 20
	}
	if cfg.MaxResponseBytes == 0 {
		cfg.MaxResponseBytes = MaxResponseBytesDefault
	}
	lockTimeout := strconv.FormatInt(max(cfg.LockTimeout.Milliseconds(), 1), 10)
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.serveHTTP(cfg, lockTimeout, next, w, r)
		})
	}, nil
}

// ParseKey returns the idempotency key an Idempotency-Key field value
// carries. A value that begins with a DQUOTE is a structured-field string
// (RFC 8941, section 3.3.3): printable ASCII (0x20-0x7E) between DQUOTEs,
// with \" and \\ the only escapes, and nothing after the closing DQUOTE
// (parameters are not accepted); the key is the unquoted string. Any other
// value is the key as sent, for compatibility. An empty key is invalid.
// Errors match ErrInvalidKey and never quote the value.
func ParseKey(value string) (string, error) {
	if !strings.HasPrefix(value, `"`) {
		if value == "" {
			return "", fmt.Errorf("%w: empty", ErrInvalidKey)
		}
		return value, nil
	}
	var b strings.Builder
	for i := 1; i < len(value); i++ {
		c := value[i]
		switch {
		case c == '\\':
			i++
			if i == len(value) || (value[i] != '"' && value[i] != '\\') {
				return "", fmt.Errorf("%w: only \\\" and \\\\ may be escaped", ErrInvalidKey)
			}
			b.WriteByte(value[i])
		case c == '"':
			if i != len(value)-1 {
				return "", fmt.Errorf("%w: characters after the closing quote", ErrInvalidKey)
			}
			if b.Len() == 0 {
				return "", fmt.Errorf("%w: empty", ErrInvalidKey)
			}
			return b.String(), nil
		case c < 0x20 || c > 0x7e:
			return "", fmt.Errorf("%w: only printable ASCII may be quoted", ErrInvalidKey)
		default:
			b.WriteByte(c)
		}
	}
	return "", fmt.Errorf("%w: no closing quote", ErrInvalidKey)
}

func (s *Store) serveHTTP(cfg HTTPConfig, lockTimeout string, next http.Handler, w http.ResponseWriter, r *http.Request) {
	fields := r.Header.Values(KeyHeader)
	if len(fields) > 1 {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("send one %s header, not %d", KeyHeader, len(fields)))
		return
	}
	if len(fields) == 0 || fields[0] == "" {
		if cfg.Required {
			httpError(w, http.StatusBadRequest, "missing "+KeyHeader+" header")
			return
		}
		next.ServeHTTP(w, r)
		return
	}
	key, err := ParseKey(fields[0])
	if err != nil {
		httpError(w, http.StatusBadRequest, KeyHeader+` must be a structured-field string: "..." of printable ASCII, with \" and \\ the only escapes (`+strings.TrimPrefix(err.Error(), ErrInvalidKey.Error()+": ")+")")
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

	// The transaction outlives a client that leaves: database/sql rolls a
	// transaction back when its context ends, and a rolled-back claim would
	// let the client's retry run the handler a second time.
	ctx := context.WithoutCancel(r.Context())
	if cfg.HandlerTimeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.HandlerTimeout)
		defer cancel()
	}
	tx, err := s.cfg.DB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		s.cfg.Logger.Error("idempotency: beginning transaction", "err", err)
		httpError(w, http.StatusServiceUnavailable, "database unavailable")
		return
	}
	defer tx.Rollback() //nolint:errcheck // no-op after Commit

	claim, err := s.claimTx(ctx, tx, req, lockTimeout, true)
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
	rec := &recorder{header: http.Header{}, code: http.StatusOK, max: cfg.MaxResponseBytes}
	next.ServeHTTP(rec, r.WithContext(context.WithValue(ctx, httpTxKey{}, delivery.DBTX(tx))))
	if rec.tooLarge {
		_ = tx.Rollback()
		s.cfg.Logger.Error("idempotency: HTTP response larger than MaxResponseBytes; request rolled back and key released",
			"scope", req.Scope, "status", rec.code, "max_response_bytes", cfg.MaxResponseBytes)
		httpError(w, http.StatusInternalServerError, "response too large to store")
		return
	}
	if retryableStatus(rec.code) {
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

// retryableStatus reports whether a handler's status says "not now" or "not
// you" rather than the request's outcome: it is not stored, and the key is
// released (see HTTPMiddleware).
func retryableStatus(code int) bool {
	switch code {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusRequestTimeout, http.StatusConflict,
		http.StatusLocked, http.StatusTooEarly, http.StatusTooManyRequests:
		return true
	}
	return code >= 500
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
	max         int64 // bound of body
	tooLarge    bool  // a write would have passed max
}

func (r *recorder) Header() http.Header { return r.header }

func (r *recorder) WriteHeader(code int) {
	if !r.wroteHeader {
		r.code, r.wroteHeader = code, true
	}
}

func (r *recorder) Write(b []byte) (int, error) {
	r.wroteHeader = true
	if r.tooLarge || int64(r.body.Len())+int64(len(b)) > r.max {
		r.tooLarge = true
		r.body = bytes.Buffer{} // never sent: free it
		return 0, ErrResponseTooLarge
	}
	return r.body.Write(b)
}

func (r *recorder) writeTo(w http.ResponseWriter) {
	for k, vs := range r.header {
		w.Header()[k] = vs
	}
	w.WriteHeader(r.code)
	_, _ = w.Write(r.body.Bytes())
}
