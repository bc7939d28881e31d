package main

// `pgsaga ui`: the operator's web view. Server-rendered pages (html/template,
// templates and CSS embedded), no script at all, nothing loaded from
// elsewhere. The pages read what the other subcommands read, through the
// same code; the buttons ask for what `retry`, `cancel` and
// `dead-letters replay` ask for.

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"database/sql"
	"embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/termsafe"
	"github.com/pgsaga/pgsaga/saga"
)

//go:embed web
var webFS embed.FS

func uiCmd() *cobra.Command {
	var (
		addr    string
		allow   []string
		serving serveFlags
	)
	cmd := &cobra.Command{
		Use:   "ui",
		Short: "Serve the operator's web view: sagas, a saga's timeline, dead letters, consumer groups",
		Long: "ui serves web pages over the database the other commands read, until SIGINT or SIGTERM: the sagas by status, " +
			"a saga's timeline drawn as a picture with Retry and Cancel buttons, the dead letters with a Replay button each, " +
			"and every consumer group. It listens on the loopback interface unless --addr says otherwise, answers only to " +
			"its host names (there, the local ones), and refuses a button press that comes from another site. Elsewhere it needs " +
			"a login (" + envUIToken + " or " + envUITokenFile + ", or " + envUIUser + " with " + envUIPassword + " or " +
			envUIPasswordFile + "; on loopback it is optional) and the host names it is reached by (--allow-host). " +
			"A token or password must be hard to guess (at least 16 characters, 6 different ones, not repeated, not a run like " +
			"0123 or abcd, not of one kind only under 24): make one with `openssl rand -hex 32`. After 10 failed logins " +
			"from one address (or 100 from all), it answers 429 with a Retry-After until the address has waited (one more " +
			"try each 6s), and logs refused logins a line a minute at most.",
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkAddr(addr); err != nil {
				return usageError{err}
			}
			names := make([]string, len(allow))
			for i, a := range allow {
				n, err := checkAllowHost(a)
				if err != nil {
					return usageError{err}
				}
				names[i] = n
			}
			auth, err := uiAuthFromEnv(os.Getenv)
			if err != nil {
				return usageError{err}
			}
			if err := exposedWithout(addr, auth, names); err != nil {
				return usageError{err}
			}
			stderr := cmd.ErrOrStderr()
			log, err := serving.logger(cmd.Flags(), stderr)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			return onFound(ctx, true, commandConns, func(db *pgdb.DB, found target) error {
				reg, stop, err := serving.serve(ctx, "ui", stderr, log)
				if err != nil {
					return err
				}
				defer stop()
				if reg != nil {
					c, err := operatorClient(db.SQL, log)
					if err != nil {
						return err
					}
					reg.MustRegister(c.Collector())
				}
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					return fmt.Errorf("cannot listen on %s: %w", addr, err)
				}
				loopback := loopbackAddr(addr)
				hosts := allowedHosts(loopback, addr, ln.Addr(), names)
				if !loopback {
					fmt.Fprintf(stderr, "pgsaga ui: reachable from other machines; it answers to %s, with the login. It speaks plain HTTP: "+
						"put a proxy that speaks HTTPS in front, or the login crosses the network readable.\n", strings.Join(hosts, ", "))
				}
				h, err := newUI(uiConfig{DB: db.SQL, Logger: log, Where: found.describe(), Hosts: hosts, Auth: auth})
				if err != nil {
					_ = ln.Close()
					return err
				}
				defer h.logins.stop()
				return serveUI(ctx, ln, h, stderr, log)
			})
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8080", "host:port to listen on (port 0: any free port); off loopback it needs a login and --allow-host")
	cmd.Flags().StringArrayVar(&allow, "allow-host", nil, "a host name (or IP address, optionally with :port) the view is reached by; repeat for each")
	serving.register(cmd.Flags(), "log one line per request")
	return cmd
}

// serveUI serves h on ln until ctx ends, then shuts down gracefully:
// requests in progress finish, within 10s.
func serveUI(ctx context.Context, ln net.Listener, h http.Handler, stderr io.Writer, log *slog.Logger) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      2 * time.Minute,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	fmt.Fprintf(stderr, "pgsaga ui: serving http://%s\n", ln.Addr())
	select {
	case err := <-served:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		_ = srv.Close()
		return fmt.Errorf("shutting down: %w", err)
	}
	<-served
	fmt.Fprintln(stderr, "pgsaga ui: stopped")
	return nil
}

// uiConfig configures the web view's handler.
type uiConfig struct {
	DB     *sql.DB
	Logger *slog.Logger
	// Where says where the database is, for the pages' header.
	Where string
	// Hosts are the Host headers answered, and the hosts of the origins a
	// button press may come from (allowedHosts). Required.
	Hosts []string
	// Auth is the login every request needs; nil for none.
	Auth *uiAuth
	// Logins limits failed logins (see loginThrottle). Zero: the
	// defaults.
	Logins loginThrottle
	// RequestWait is how long a Retry or Cancel waits for a worker to
	// carry the request out before the page says it is pending. Default 3s.
	RequestWait time.Duration
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// webUI is the web view: an http.Handler.
type webUI struct {
	cfg      uiConfig
	log      *slog.Logger
	client   *saga.Client // never started: reads sagas, asks the workers
	pages    map[string]*template.Template
	flashKey []byte
	handler  http.Handler
	cssHash  string
	logins   *loginGuard
}

const (
	pageSagas       = "sagas.html"
	pageSaga        = "saga.html"
	pageDeadLetters = "deadletters.html"
	pageDeadLetter  = "deadletter.html"
	pageConsumers   = "consumers.html"
	pageError       = "error.html"
)

func newUI(cfg uiConfig) (*webUI, error) {
	if cfg.DB == nil || len(cfg.Hosts) == 0 {
		return nil, errors.New("ui: DB and Hosts are required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.RequestWait <= 0 {
		cfg.RequestWait = 3 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	client, err := operatorClient(cfg.DB, cfg.Logger)
	if err != nil {
		return nil, err
	}
	u := &webUI{cfg: cfg, log: cfg.Logger, client: client, pages: map[string]*template.Template{},
		logins: newLoginGuard(cfg.Logins, cfg.Now, cfg.Logger)}
	u.flashKey = make([]byte, 32)
	if _, err := rand.Read(u.flashKey); err != nil {
		return nil, err
	}
	for _, p := range []string{pageSagas, pageSaga, pageDeadLetters, pageDeadLetter, pageConsumers, pageError} {
		t, err := template.New(p).Funcs(templateFuncs).ParseFS(webFS, "web/layout.html", "web/partials.html", "web/timeline.svg.html", "web/"+p)
		if err != nil {
			return nil, fmt.Errorf("ui: template %s: %w", p, err)
		}
		u.pages[p] = t
	}
	css, err := webFS.ReadFile("web/static/style.css")
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256(css)
	u.cssHash = fmt.Sprintf("%x", sum[:6])
	static, err := fs.Sub(webFS, "web/static")
	if err != nil {
		return nil, err
	}

	mux := http.NewServeMux()
	mux.Handle("GET /{$}", u.page(u.sagas))
	mux.Handle("GET /sagas", u.page(u.sagas))
	mux.Handle("GET /sagas/{id}", u.page(u.saga))
	mux.Handle("POST /sagas/{id}/retry", u.page(u.askRetry))
	mux.Handle("POST /sagas/{id}/cancel", u.page(u.askCancel))
	mux.Handle("GET /dead-letters", u.page(u.deadLetters))
	mux.Handle("GET /dead-letters/{id}", u.page(u.deadLetter))
	mux.Handle("GET /dead-letters/{id}/payload", u.page(u.deadLetterPayload))
	mux.Handle("POST /dead-letters/{id}/replay", u.page(u.replay))
	mux.Handle("GET /consumers", u.page(u.consumers))
	mux.HandleFunc("GET /healthz", u.healthz)
	mux.Handle("GET /static/{file}", http.StripPrefix("/static/", cacheFor(time.Hour, http.FileServerFS(static))))
	mux.Handle("/", u.page(func(w http.ResponseWriter, r *http.Request) error {
		return notFound("There is no page at %s. The pages are Sagas, Dead letters and Consumers, in the bar above.", r.URL.Path)
	}))
	u.handler = u.logRequests(u.recoverPanics(securityHeaders(u.checkHost(u.checkAuth(u.checkOrigin(u.checkInput(mux)))))))
	return u, nil
}

func (u *webUI) ServeHTTP(w http.ResponseWriter, r *http.Request) { u.handler.ServeHTTP(w, r) }

// httpError is a page that says what was wrong with the request.
type httpError struct {
	status int
	msg    string
}

func (e *httpError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return &httpError{http.StatusBadRequest, fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) error {
	return &httpError{http.StatusNotFound, fmt.Sprintf(format, args...)}
}

// page turns a handler that returns an error into one that renders it:
// a 4xx page with the sentence it gives, or a 500 page (logged).
func (u *webUI) page(fn func(w http.ResponseWriter, r *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		err := fn(w, r)
		if err == nil {
			return
		}
		var he *httpError
		if !errors.As(err, &he) {
			if r.Context().Err() != nil {
				return // the browser went away
			}
			u.log.Error("ui: request failed", "method", r.Method, "path", r.URL.Path, "err", err)
			he = &httpError{http.StatusInternalServerError, "The page could not be made: " + err.Error()}
		}
		u.render(w, r, he.status, pageError, "", errorView{Status: he.status, StatusText: http.StatusText(he.status), Message: he.msg})
	})
}

type errorView struct {
	Status     int
	StatusText string
	Message    string
}

// pageData is what the layout renders around a page.
type pageData struct {
	Title   string
	Nav     string
	Where   string
	Flash   *flash
	Refresh int // seconds; 0 for none
	Now     string
	CSS     string
	Page    any
}

// render writes page with data, and the flash message the last POST left.
func (u *webUI) render(w http.ResponseWriter, r *http.Request, status int, page, nav string, data any) {
	pd := pageData{Title: titles[page], Nav: nav, Where: u.cfg.Where, Page: data, CSS: u.cssHash,
		Now: u.cfg.Now().UTC().Format("2006-01-02 15:04:05 UTC")}
	if e, ok := data.(errorView); ok {
		pd.Title = fmt.Sprintf("%d %s", e.Status, e.StatusText)
	}
	if t, ok := data.(interface{ title() string }); ok {
		pd.Title = t.title()
	}
	if rf, ok := data.(interface{ refresh() int }); ok {
		pd.Refresh = rf.refresh()
	}
	pd.Flash = u.takeFlash(w, r)
	var buf bytes.Buffer
	if err := u.pages[page].ExecuteTemplate(&buf, "layout", pd); err != nil {
		u.log.Error("ui: rendering", "page", page, "err", err)
		plainError(w, http.StatusInternalServerError, "pgsaga ui: the page could not be rendered: "+err.Error())
		return
	}
	// Whatever the database held, the page holds no control character:
	// html/template escapes markup, not them.
	out := printableBytes(buf.Bytes())
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(len(out)))
	w.WriteHeader(status)
	_, _ = w.Write(out)
}

// printable is s as text a page can show (termsafe.Text): control
// characters but tab and newline, the characters that reorder text (which
// can make one string look like another) and bytes that are not UTF-8 are
// written out as \x1b, \u202e or \xff.
func printable(s string) string { return termsafe.Text(s) }

// printableBytes is printable for b, b itself if it is printable already.
func printableBytes(b []byte) []byte {
	if termsafe.Clean(string(b)) {
		return b
	}
	return []byte(termsafe.Text(string(b)))
}

var titles = map[string]string{pageSagas: "Sagas", pageSaga: "Saga", pageDeadLetters: "Dead letters", pageDeadLetter: "Dead letter", pageConsumers: "Consumers"}

// flash is a message a POST leaves for the page it redirects to.
type flash struct {
	Kind    string `json:"k"` // ok, error, info
	Message string `json:"m"`
}

const flashCookie = "pgsaga_flash"

// redirect ends a POST: a 303 to target (a path of this server), with msg
// for the page there (POST-redirect-GET). The message travels in a
// short-lived cookie signed with a key of this process, so no other site
// or link can make the page say something.
func (u *webUI) redirect(w http.ResponseWriter, r *http.Request, target string, f flash) {
	f.Message = clip(f.Message, 1500)
	raw, _ := json.Marshal(f)
	mac := hmac.New(sha256.New, u.flashKey)
	mac.Write(raw)
	value := base64.RawURLEncoding.EncodeToString(raw) + "." + base64.RawURLEncoding.EncodeToString(mac.Sum(nil))
	http.SetCookie(w, &http.Cookie{Name: flashCookie, Value: value, Path: "/", MaxAge: 60, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, target, http.StatusSeeOther)
}

// takeFlash returns the flash message of the request, if any, and clears it.
func (u *webUI) takeFlash(w http.ResponseWriter, r *http.Request) *flash {
	c, err := r.Cookie(flashCookie)
	if err != nil {
		return nil
	}
	http.SetCookie(w, &http.Cookie{Name: flashCookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	payload, sig, ok := strings.Cut(c.Value, ".")
	if !ok {
		return nil
	}
	raw, err1 := base64.RawURLEncoding.DecodeString(payload)
	got, err2 := base64.RawURLEncoding.DecodeString(sig)
	if err1 != nil || err2 != nil {
		return nil
	}
	mac := hmac.New(sha256.New, u.flashKey)
	mac.Write(raw)
	if !hmac.Equal(got, mac.Sum(nil)) {
		return nil
	}
	var f flash
	if json.Unmarshal(raw, &f) != nil || f.Message == "" {
		return nil
	}
	switch f.Kind {
	case "ok", "error", "info":
	default:
		f.Kind = "info"
	}
	return &f
}

// localPath is target if it is a path of this server (for a redirect),
// else def.
func localPath(target, def string) string {
	if target == "" || !strings.HasPrefix(target, "/") || strings.HasPrefix(target, "//") || strings.ContainsAny(target, "\\\r\n") {
		return def
	}
	p, err := url.Parse(target)
	if err != nil || p.Scheme != "" || p.Host != "" || p.User != nil {
		return def
	}
	return p.RequestURI()
}

// securityHeaders: no script may run, no other site may frame a page or
// receive a form, nothing is cached.
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cache-Control", "no-store")
		next.ServeHTTP(w, r)
	})
}

func cacheFor(d time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", fmt.Sprintf("public, max-age=%d", int(d.Seconds())))
		next.ServeHTTP(w, r)
	})
}

// statusRecorder notes what a handler answered, for the request log.
type statusRecorder struct {
	http.ResponseWriter
	status int
	bytes  int
}

func (s *statusRecorder) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(p []byte) (int, error) {
	if s.status == 0 {
		s.status = http.StatusOK
	}
	n, err := s.ResponseWriter.Write(p)
	s.bytes += n
	return n, err
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// logRequests logs one line per request, at debug level.
func (u *webUI) logRequests(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !u.log.Enabled(r.Context(), slog.LevelDebug) {
			next.ServeHTTP(w, r)
			return
		}
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w}
		next.ServeHTTP(rec, r)
		u.log.LogAttrs(r.Context(), slog.LevelDebug, "request", slog.String("method", r.Method), slog.String("uri", r.URL.RequestURI()),
			slog.Int("status", rec.status), slog.Int("bytes", rec.bytes), slog.Float64("took_ms", telemetry.Millis(time.Since(start))),
			slog.String("remote", r.RemoteAddr))
	})
}

// recoverPanics turns a handler's panic into a 500 page and a log line.
func (u *webUI) recoverPanics(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			p := recover()
			if p == nil {
				return
			}
			if p == http.ErrAbortHandler {
				panic(p)
			}
			u.log.Error("ui: handler panicked", "method", r.Method, "path", r.URL.Path, "panic", p)
			u.render(w, r, http.StatusInternalServerError, pageError, "", errorView{Status: http.StatusInternalServerError,
				StatusText: http.StatusText(http.StatusInternalServerError), Message: fmt.Sprintf("The page could not be made: %v", p)})
		}()
		next.ServeHTTP(w, r)
	})
}

// healthz answers 200 while the database answers.
func (u *webUI) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err := u.cfg.DB.PingContext(ctx); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, printable("database unreachable: "+err.Error()))
		return
	}
	fmt.Fprintln(w, "ok")
}
