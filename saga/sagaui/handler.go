package sagaui

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"embed"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pgsaga/pgsaga/internal/present"
	"github.com/pgsaga/pgsaga/internal/telemetry"
	"github.com/pgsaga/pgsaga/internal/termsafe"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
)

//go:embed web
var webFS embed.FS

// Config configures the web view.
type Config struct {
	// Client reads the sagas, dead letters and consumer groups, and asks
	// the workers for retries and cancels: an operator's client
	// (saga.NewClientFromDB), never started. Required.
	Client *saga.Client

	// Prefix is the path the view is mounted at, as the server in front
	// routes it ("/admin/sagas": the view answers /admin/sagas/ and what
	// is under it, and its links and forms point there). "" for the root.
	Prefix string

	// Hosts, if set, are the only Host headers answered, and the hosts of
	// the origins a button press may come from (a guard against DNS
	// rebinding for a view served on its own, as pgsaga ui does). Unset,
	// the server in front decides which hosts reach the view, and a button
	// press must come from a page of the host it is sent to.
	Hosts []string

	// Where says where the database is, for the pages' header. Optional.
	Where string

	// Logger receives the view's failures, refusals, and a line per
	// request at Debug. Default: nothing is logged.
	Logger *slog.Logger

	// RequestWait is how long a Retry or Cancel waits for a worker to
	// carry the request out before the page says it is pending. Default:
	// RequestWaitDefault.
	RequestWait time.Duration

	// Now is the clock of the pages' footer. Default: time.Now. (Ages and
	// deadlines are the database's.)
	Now func() time.Time
}

// RequestWaitDefault is Config.RequestWait's default.
const RequestWaitDefault = 3 * time.Second

// Handler is the web view, an http.Handler: no JavaScript, a strict
// Content-Security-Policy, buttons (Retry, Cancel, Replay) that refuse a
// press from another site, input that cannot be stored refused. It has no
// login of its own: mount it behind the server's authentication, as
//
//	mux.Handle("/admin/sagas/", requireOperator(ui)) // ui from New(Config{Client: c, Prefix: "/admin/sagas"})
type Handler struct {
	cfg      Config
	log      *slog.Logger
	client   *saga.Client // never started: reads sagas, asks the workers
	pages    map[string]*template.Template
	flashKey []byte
	handler  http.Handler
	cssHash  string
}

const (
	pageSagas       = "sagas.html"
	pageSaga        = "saga.html"
	pageDeadLetters = "deadletters.html"
	pageDeadLetter  = "deadletter.html"
	pageConsumers   = "consumers.html"
	pageError       = "error.html"
)

// New validates cfg and returns the view.
func New(cfg Config) (*Handler, error) {
	var errs []error
	if cfg.Client == nil {
		errs = append(errs, errors.New("Client is required"))
	}
	if cfg.Prefix != "" && (!strings.HasPrefix(cfg.Prefix, "/") || strings.HasSuffix(cfg.Prefix, "/") || strings.ContainsAny(cfg.Prefix, "?#\\\"<>'{} ") ||
		path.Clean(cfg.Prefix) != cfg.Prefix) {
		errs = append(errs, fmt.Errorf("Prefix must be a clean path that starts with / and does not end with one, like /admin/sagas; got %q", cfg.Prefix))
	}
	for i, h := range cfg.Hosts {
		cfg.Hosts[i] = strings.ToLower(h)
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.RequestWait <= 0 {
		cfg.RequestWait = RequestWaitDefault
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	u := &Handler{cfg: cfg, log: cfg.Logger, client: cfg.Client, pages: map[string]*template.Template{}}
	u.flashKey = make([]byte, 32)
	if _, err := rand.Read(u.flashKey); err != nil {
		return nil, err
	}
	funcs := template.FuncMap{"base": func() string { return cfg.Prefix }}
	maps.Copy(funcs, templateFuncs)
	for _, p := range []string{pageSagas, pageSaga, pageDeadLetters, pageDeadLetter, pageConsumers, pageError} {
		t, err := template.New(p).Funcs(funcs).ParseFS(webFS, "web/layout.html", "web/partials.html", "web/timeline.svg.html", "web/"+p)
		if err != nil {
			return nil, fmt.Errorf("sagaui: template %s: %w", p, err)
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
	mux.Handle("GET /sagas/find", u.page(u.find))
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
		return notFound("There is no page at %s. The pages are Sagas, Dead letters and Consumers, in the bar above.", u.href(r.URL.Path))
	}))
	var inner http.Handler = mux
	if cfg.Prefix != "" {
		inner = u.underPrefix(mux)
	}
	u.handler = u.logRequests(u.recoverPanics(securityHeaders(u.checkHost(u.checkOrigin(u.checkInput(inner))))))
	return u, nil
}

// href is the link to path, a path of the view (/sagas/…), where the view
// is mounted.
func (u *Handler) href(path string) string { return u.cfg.Prefix + path }

// underPrefix serves the view's paths under the prefix, and answers 404
// what is outside it.
func (u *Handler) underPrefix(mux http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rest, ok := strings.CutPrefix(r.URL.Path, u.cfg.Prefix)
		if !ok || rest != "" && !strings.HasPrefix(rest, "/") {
			http.NotFound(w, r)
			return
		}
		if rest == "" {
			http.Redirect(w, r, u.cfg.Prefix+"/", http.StatusMovedPermanently)
			return
		}
		r2 := r.Clone(r.Context())
		r2.URL.Path, r2.URL.RawPath = rest, ""
		mux.ServeHTTP(w, r2)
	})
}

// ServeHTTP implements http.Handler.
func (u *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { u.handler.ServeHTTP(w, r) }

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
func (u *Handler) page(fn func(w http.ResponseWriter, r *http.Request) error) http.Handler {
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
func (u *Handler) render(w http.ResponseWriter, r *http.Request, status int, page, nav string, data any) {
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

// redirect ends a POST: a 303 to target (a path of the view, under its
// prefix), with msg
// for the page there (POST-redirect-GET). The message travels in a
// short-lived cookie signed with a key of this process, so no other site
// or link can make the page say something.
func (u *Handler) redirect(w http.ResponseWriter, r *http.Request, target string, f flash) {
	f.Message = present.Clip(f.Message, 1500)
	raw, _ := json.Marshal(f)
	mac := hmac.New(sha256.New, u.flashKey)
	mac.Write(raw)
	value := base64.RawURLEncoding.EncodeToString(raw) + "." + base64.RawURLEncoding.EncodeToString(mac.Sum(nil))
	http.SetCookie(w, &http.Cookie{Name: flashCookie, Value: value, Path: u.href("/"), MaxAge: 60, HttpOnly: true, SameSite: http.SameSiteStrictMode})
	http.Redirect(w, r, u.href(target), http.StatusSeeOther)
}

// takeFlash returns the flash message of the request, if any, and clears it.
func (u *Handler) takeFlash(w http.ResponseWriter, r *http.Request) *flash {
	c, err := r.Cookie(flashCookie)
	if err != nil {
		return nil
	}
	http.SetCookie(w, &http.Cookie{Name: flashCookie, Value: "", Path: u.href("/"), MaxAge: -1, HttpOnly: true, SameSite: http.SameSiteStrictMode})
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
func (u *Handler) logRequests(next http.Handler) http.Handler {
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
func (u *Handler) recoverPanics(next http.Handler) http.Handler {
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
func (u *Handler) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	if err := u.client.DB().PingContext(ctx); err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintln(w, printable("database unreachable: "+err.Error()))
		return
	}
	fmt.Fprintln(w, "ok")
}

// answersTo reports whether host (a Host header, or an origin's host) is
// one of the server's names.
func (u *Handler) answersTo(host string) bool {
	return slices.Contains(u.cfg.Hosts, strings.ToLower(host))
}

// fromOrigin reports whether a button press whose Origin names host may
// be taken for r: from one of Config.Hosts, or, without them, from the
// host r was sent to.
func (u *Handler) fromOrigin(host string, r *http.Request) bool {
	if len(u.cfg.Hosts) == 0 {
		return strings.EqualFold(host, r.Host)
	}
	return u.answersTo(host)
}

// checkHost refuses a request for a host name the server does not answer
// to (Config.Hosts; without them, every host), saying nothing of the
// database: a page of a site
// whose name was pointed at this machine can read the answer.
func (u *Handler) checkHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if len(u.cfg.Hosts) == 0 || u.answersTo(r.Host) {
			next.ServeHTTP(w, r)
			return
		}
		u.logRefusal(r)
		plainError(w, http.StatusForbidden, fmt.Sprintf("sagaui: this server does not answer to the host name %q.", r.Host))
	})
}

// checkOrigin refuses a request that changes something (anything but GET
// and HEAD) unless it comes from a page of one of the server's names: the
// Origin the browser sends, never the Host the request names (a page whose
// name was pointed at this machine names its own).
func (u *Handler) checkOrigin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet || r.Method == http.MethodHead {
			next.ServeHTTP(w, r)
			return
		}
		if err := u.sameOrigin(r); err != nil {
			u.logRefusal(r)
			u.render(w, r, http.StatusForbidden, pageError, "", errorView{Status: http.StatusForbidden, StatusText: http.StatusText(http.StatusForbidden),
				Message: "Refused: " + err.Error() + ". Use the buttons of these pages; nothing was changed."})
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, 64<<10)
		next.ServeHTTP(w, r)
	})
}

func (u *Handler) sameOrigin(r *http.Request) error {
	switch site := r.Header.Get("Sec-Fetch-Site"); site {
	case "", "same-origin":
	default:
		return fmt.Errorf("the request came from another site (Sec-Fetch-Site: %q)", site)
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		return fmt.Errorf("the request does not say where it comes from (no Origin header; a script must send the origin of a page of this server, like http://%s)", r.Host)
	}
	o, err := url.Parse(origin)
	if err != nil || o.Scheme != "http" && o.Scheme != "https" || o.Host == "" || o.User != nil || o.Path != "" || o.RawQuery != "" || o.Fragment != "" ||
		!u.fromOrigin(o.Host, r) {
		return fmt.Errorf("the request came from %q, not from a page of this server", origin)
	}
	return nil
}

func (u *Handler) logRefusal(r *http.Request) {
	u.log.Warn("ui: request refused", "method", r.Method, "path", r.URL.Path, "host", r.Host, "origin", r.Header.Get("Origin"),
		"sec_fetch_site", r.Header.Get("Sec-Fetch-Site"), "remote", r.RemoteAddr)
}

// checkInput answers 400 a request whose query or form cannot be read, or
// holds a name or value that is not text PostgreSQL can keep (bytes that
// are not UTF-8, a NUL): no filter or button takes one, and the database
// would refuse it. The page names the parameter, escaped, not its value.
func (u *Handler) checkInput(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var err error
		if perr := r.ParseForm(); perr != nil {
			err = badRequest("Bad request: the query or form could not be read (%v); nothing was done.", perr)
		} else {
			err = unreadableForm(r.Form)
		}
		if err != nil {
			u.page(func(http.ResponseWriter, *http.Request) error { return err }).ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func unreadableForm(form url.Values) error {
	for _, name := range slices.Sorted(maps.Keys(form)) {
		if why := transport.Unstorable(name); why != "" {
			return badRequest("Bad request: the name of a parameter holds %s; nothing was done.", why)
		}
		for _, v := range form[name] {
			if why := transport.Unstorable(v); why != "" {
				return badRequest("Bad request: %q holds %s; nothing was done.", name, why)
			}
		}
	}
	return nil
}

// plainError answers a request refused before it may see anything of the
// database: a line of text, not a page (which says where the database is).
func plainError(w http.ResponseWriter, status int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, printable(msg)+"\n")
}
