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
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/pgsaga/pgsaga/internal/finddb"
	"github.com/pgsaga/pgsaga/internal/pgdb"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/steps/transport"
)

//go:embed web
var webFS embed.FS

func uiCmd() *cobra.Command {
	var (
		addr    string
		verbose bool
	)
	cmd := &cobra.Command{
		Use:   "ui",
		Short: "Serve the operator's web view: sagas, a saga's timeline, dead letters, consumer groups",
		Long: "ui serves web pages over the database the other commands read, until SIGINT or SIGTERM: the sagas by status, " +
			"a saga's timeline drawn as a picture with Retry and Cancel buttons, the dead letters with a Replay button each, " +
			"and every consumer group. There is no login: it listens on the loopback interface unless --addr says otherwise, " +
			"answers there only to local host names, and refuses a button press that comes from another site.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkAddr(addr); err != nil {
				return usageError{err}
			}
			level := slog.LevelInfo
			if verbose {
				level = slog.LevelDebug
			}
			stderr := cmd.ErrOrStderr()
			log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level}))
			ctx := cmd.Context()
			return onFound(ctx, true, commandConns, func(db *pgdb.DB, found *finddb.Found) error {
				tr, err := transport.New(transport.Config{DB: db.SQL})
				if err != nil {
					return err
				}
				ln, err := net.Listen("tcp", addr)
				if err != nil {
					return fmt.Errorf("cannot listen on %s: %w", addr, err)
				}
				hosts := allowedHosts(addr, ln.Addr())
				if hosts == nil {
					fmt.Fprintf(stderr, "pgsaga ui: %s is reachable from other machines and has no login: anyone who reaches it can retry, "+
						"cancel and replay. Prefer 127.0.0.1 with an SSH tunnel, or an authenticating proxy in front.\n", ln.Addr())
				}
				h, err := newUI(uiConfig{DB: db.SQL, Transport: tr, Logger: log, Where: found.Describe(), Hosts: hosts})
				if err != nil {
					_ = ln.Close()
					return err
				}
				return serveUI(ctx, ln, h, stderr, log)
			})
		},
	}
	cmd.Flags().StringVar(&addr, "addr", "127.0.0.1:8080", "host:port to listen on (port 0: any free port)")
	cmd.Flags().BoolVarP(&verbose, "verbose", "v", false, "log one line per request on stderr (at debug level)")
	return cmd
}

// checkAddr says what is wrong with a listening address, if anything.
func checkAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--addr %q: want host:port, like 127.0.0.1:8080", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("--addr %q: the port must be a number from 0 to 65535", addr)
	}
	if host != "" && net.ParseIP(host) == nil && !hostName(host) {
		return fmt.Errorf("--addr %q: %q is neither an IP address nor a host name", addr, host)
	}
	return nil
}

// hostName reports whether s is a syntactically valid DNS name.
func hostName(s string) bool {
	if len(s) > 253 {
		return false
	}
	for _, label := range strings.Split(s, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

// allowedHosts is the Host headers a server bound to bound answers to: on
// a loopback address, only the machine's own names for it (a page of
// another site whose name was pointed at 127.0.0.1, DNS rebinding, gets
// nothing); elsewhere any (nil), since the names it is reached by are
// unknown.
func allowedHosts(flagAddr string, bound net.Addr) []string {
	tcp, ok := bound.(*net.TCPAddr)
	if !ok || !tcp.IP.IsLoopback() {
		return nil
	}
	port := strconv.Itoa(tcp.Port)
	names := []string{"localhost", "127.0.0.1", "[::1]"}
	if ip := tcp.IP.String(); tcp.IP.To4() == nil {
		names = append(names, "["+ip+"]")
	} else {
		names = append(names, ip)
	}
	if h, _, err := net.SplitHostPort(flagAddr); err == nil && h != "" {
		if strings.Contains(h, ":") {
			h = "[" + h + "]"
		}
		names = append(names, h)
	}
	var out []string
	for _, n := range names {
		out = append(out, strings.ToLower(n)+":"+port)
		if port == "80" {
			out = append(out, strings.ToLower(n))
		}
	}
	return out
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
	DB        *sql.DB
	Transport *transport.Transport
	Logger    *slog.Logger
	// Where says where the database is, for the pages' header.
	Where string
	// Hosts are the Host headers answered (lower case, with the port); nil
	// answers any.
	Hosts []string
	// RequestWait is how long a Retry or Cancel waits for a worker to
	// carry the request out before the page says it is pending. Default 3s.
	RequestWait time.Duration
	// Now is the clock. Default time.Now.
	Now func() time.Time
}

// webUI is the web view: an http.Handler.
type webUI struct {
	cfg       uiConfig
	log       *slog.Logger
	inspector *saga.Inspector
	engine    *saga.Engine // counts instances; drives none
	pages     map[string]*template.Template
	flashKey  []byte
	handler   http.Handler
	cssHash   string
}

const (
	pageSagas       = "sagas.html"
	pageSaga        = "saga.html"
	pageDeadLetters = "deadletters.html"
	pageConsumers   = "consumers.html"
	pageError       = "error.html"
)

func newUI(cfg uiConfig) (*webUI, error) {
	if cfg.DB == nil || cfg.Transport == nil {
		return nil, errors.New("ui: DB and Transport are required")
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
	engine, err := saga.NewEngine(saga.Config{DB: cfg.DB, Transport: cfg.Transport, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	u := &webUI{cfg: cfg, log: cfg.Logger, inspector: saga.NewInspector(cfg.DB), engine: engine, pages: map[string]*template.Template{}}
	u.flashKey = make([]byte, 32)
	if _, err := rand.Read(u.flashKey); err != nil {
		return nil, err
	}
	for _, p := range []string{pageSagas, pageSaga, pageDeadLetters, pageConsumers, pageError} {
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
	mux.Handle("POST /dead-letters/{id}/replay", u.page(u.replay))
	mux.Handle("GET /consumers", u.page(u.consumers))
	mux.HandleFunc("GET /healthz", u.healthz)
	mux.Handle("GET /static/{file}", http.StripPrefix("/static/", cacheFor(time.Hour, http.FileServerFS(static))))
	mux.Handle("/", u.page(func(w http.ResponseWriter, r *http.Request) error {
		return notFound("There is no page at %s. The pages are Sagas, Dead letters and Consumers, in the bar above.", r.URL.Path)
	}))
	u.handler = u.logRequests(u.recoverPanics(securityHeaders(u.checkHost(u.checkOrigin(mux)))))
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
		http.Error(w, "pgsaga ui: the page could not be rendered: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Content-Length", strconv.Itoa(buf.Len()))
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

var titles = map[string]string{pageSagas: "Sagas", pageSaga: "Saga", pageDeadLetters: "Dead letters", pageConsumers: "Consumers"}

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

// checkHost refuses a request for a host name the server does not answer
// to (see allowedHosts).
func (u *webUI) checkHost(next http.Handler) http.Handler {
	if u.cfg.Hosts == nil {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		host := strings.ToLower(r.Host)
		for _, h := range u.cfg.Hosts {
			if host == h {
				next.ServeHTTP(w, r)
				return
			}
		}
		u.refuse(w, r, fmt.Sprintf("This server answers to %s, not to the host name %q: it refuses other names so that a page of another site cannot reach it through a name pointed at this machine.",
			strings.Join(u.cfg.Hosts, ", "), r.Host))
	})
}

// checkOrigin refuses a request that changes something (anything but GET
// and HEAD) unless it comes from a page of this server: the browser says
// so in Sec-Fetch-Site, or, for one that does not send it, in Origin.
func (u *webUI) checkOrigin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet || r.Method == http.MethodHead {
			next.ServeHTTP(w, r)
			return
		}
		if err := sameOrigin(r); err != nil {
			u.refuse(w, r, "Refused: "+err.Error()+". Use the buttons of these pages; nothing was changed.")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		next.ServeHTTP(w, r)
	})
}

func sameOrigin(r *http.Request) error {
	switch site := r.Header.Get("Sec-Fetch-Site"); site {
	case "same-origin":
		return nil
	case "":
	default:
		return fmt.Errorf("the request came from another site (Sec-Fetch-Site: %s)", site)
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return fmt.Errorf("the request does not say where it comes from (no Origin header; a script must send Origin: http://%s)", r.Host)
	}
	if !strings.EqualFold(origin, "http://"+r.Host) && !strings.EqualFold(origin, "https://"+r.Host) {
		return fmt.Errorf("the request came from %s, not from a page of this server (%s)", origin, r.Host)
	}
	return nil
}

func (u *webUI) refuse(w http.ResponseWriter, r *http.Request, msg string) {
	u.log.Warn("ui: request refused", "method", r.Method, "path", r.URL.Path, "host", r.Host, "origin", r.Header.Get("Origin"),
		"sec_fetch_site", r.Header.Get("Sec-Fetch-Site"), "remote", r.RemoteAddr)
	u.render(w, r, http.StatusForbidden, pageError, "", errorView{Status: http.StatusForbidden, StatusText: http.StatusText(http.StatusForbidden), Message: msg})
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
			slog.Int("status", rec.status), slog.Int("bytes", rec.bytes), slog.Duration("took", time.Since(start).Round(time.Microsecond)),
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
		fmt.Fprintln(w, "database unreachable:", err)
		return
	}
	fmt.Fprintln(w, "ok")
}
