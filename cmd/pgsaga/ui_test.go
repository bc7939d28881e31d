package main

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/metadata"
	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/internal/transport"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/delivery"
)

// uiWorld is a database filled by real runs, and the web view serving it
// on a real listener.
type uiWorld struct {
	uiServer
	db         *sql.DB
	tr         *transport.Transport
	jobs       *saga.Client
	start      func(job string) uuid.UUID
	refuseUndo *atomic.Bool
	// The order-payment sample: one saga completed, one compensated.
	paid, unpaid uuid.UUID
	// The job saga: one parked (a cancel whose compensation was refused),
	// one running.
	parked, running uuid.UUID
	// Dead letters: one of the parked saga, full of markup and bytes that
	// are not text; one published to a topic nobody reads.
	hostile, lost int64
}

const hostileMarkup = "<script>alert(1)</script>"

func newUIWorld(t *testing.T, cfg uiConfig, opts ...uiServing) *uiWorld {
	t.Helper()
	ctx := context.Background()
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	w := &uiWorld{db: db.SQL, refuseUndo: &atomic.Bool{}}
	w.paid, w.unpaid = sampleRunOn(t, db)
	w.refuseUndo.Store(true)
	w.jobs, w.start = jobSagaOn(t, db, w.refuseUndo)
	w.parked = w.start("parked")
	_, err := mustOperator(t, db.SQL).Ask(ctx, w.parked, saga.RequestCancel, "wrong customer")
	require.NoError(t, err)
	waitStatus(t, w.jobs, w.parked, saga.StatusFailed)
	w.running = w.start("running")

	w.tr, err = transport.New(transport.Config{DB: db.SQL})
	require.NoError(t, err)
	hostile := message.NewMessage(uuid.NewString(), []byte("\xff\xfe"+hostileMarkup+"\x00 end"))
	hostile.Metadata.Set(metadata.Type, hostileMarkup)
	hostile.Metadata.Set(metadata.SagaID, w.parked.String())
	hostile.Metadata.Set("note", "</td></table><script>alert('metadata')</script>")
	require.NoError(t, w.tr.Publisher(db.SQL).Publish("jobs.undo", hostile))
	eventually(t, "the step runtime dead-letters the message it cannot decode", func() bool {
		dl, err := w.tr.DeadLetters(ctx, delivery.DeadLetterFilter{Topic: "jobs.undo"})
		require.NoError(t, err)
		if len(dl) > 0 {
			w.hostile = dl[0].ID
		}
		return len(dl) > 0
	})
	dl, err := w.tr.DeadLetters(ctx, delivery.DeadLetterFilter{Topic: "nobody.reads"})
	require.NoError(t, err)
	require.Len(t, dl, 1)
	w.lost = dl[0].ID

	var o uiServing
	if len(opts) > 0 {
		o = opts[0]
	}
	w.uiServer = serveTestUI(t, db.URL, cfg, o)
	return w
}

// uiServer is the web view served on a real listener of 127.0.0.1.
type uiServer struct {
	// base is where its pages are asked for: http://127.0.0.1:port, or,
	// served as exposed, http://NAME:port (the tests' clients dial the
	// listener whatever name they ask for).
	base string
	addr string // where it listens
	port string
	log  *testout.Buffer
}

// testWhere is where the tests' views say the database is.
const testWhere = "the test database"

// uiServing is how a test serves the web view.
type uiServing struct {
	// Allow, if any, serves it as exposed to other machines, as `pgsaga ui
	// --addr 0.0.0.0:port --allow-host NAME...` does, though it listens on
	// 127.0.0.1; without, as on loopback.
	Allow []string
	// Wrap, if set, wraps the view's handler (a test's own pages beside it).
	Wrap func(http.Handler) http.Handler
}

// serveTestUI serves the web view with cfg over the database at dbURL, on
// a pool of its own as the command opens one, until the test ends.
func serveTestUI(t *testing.T, dbURL string, cfg uiConfig, o uiServing) uiServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := uiServer{addr: ln.Addr().String(), port: strconv.Itoa(ln.Addr().(*net.TCPAddr).Port), log: &testout.Buffer{}}
	cfg.DB = testdb.Open(t, dbURL, 4).SQL
	cfg.Logger = slog.New(slog.NewTextHandler(s.log, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg.Where = testWhere
	if len(o.Allow) == 0 {
		cfg.Hosts = allowedHosts(true, s.addr, ln.Addr(), nil)
		s.base = "http://" + s.addr
	} else {
		cfg.Hosts = allowedHosts(false, "0.0.0.0:"+s.port, ln.Addr(), o.Allow)
		s.base = "http://" + o.Allow[0] + ":" + s.port
	}
	ui, err := newUI(cfg)
	require.NoError(t, err)
	var h http.Handler = ui
	if o.Wrap != nil {
		h = o.Wrap(h)
	}
	serveCtx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- serveUI(serveCtx, ln, h, io.Discard, cfg.Logger) }()
	t.Cleanup(func() {
		stop()
		require.NoError(t, <-served)
		ui.logins.stop()
	})
	return s
}

// eventually waits until cond holds, checking every 20ms, for 30s at most.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		require.True(t, time.Now().Before(deadline), "timed out waiting: %s", what)
		time.Sleep(20 * time.Millisecond)
	}
}

// browser is an HTTP client that keeps cookies and does not follow
// redirects, so that a test sees each. It dials the view whatever host
// name it asks for, as if every name pointed at it.
type browser struct {
	t    *testing.T
	c    *http.Client
	base string
	// authorization, if set, is the Authorization header of every request
	// that does not give its own.
	authorization string
}

func (s uiServer) browser(t *testing.T) *browser {
	jar, err := cookiejar.New(nil)
	require.NoError(t, err)
	dial := func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, s.addr)
	}
	return &browser{t: t, base: s.base, c: &http.Client{Jar: jar, Timeout: 30 * time.Second, Transport: &http.Transport{DialContext: dial},
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

type answer struct {
	status   int
	body     string
	location string
	header   http.Header
}

func (b *browser) do(method, path string, form url.Values, header map[string]string) answer {
	b.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, b.base+path, body)
	require.NoError(b.t, err)
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if b.authorization != "" {
		req.Header.Set("Authorization", b.authorization)
	}
	for k, v := range header {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := b.c.Do(req)
	require.NoError(b.t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(b.t, err)
	return answer{status: resp.StatusCode, body: string(raw), location: resp.Header.Get("Location"), header: resp.Header}
}

func (b *browser) get(path string) answer { b.t.Helper(); return b.do(http.MethodGet, path, nil, nil) }

// press is a button of a page: a POST from this server's origin.
func (b *browser) press(path string, form url.Values) answer {
	b.t.Helper()
	if form == nil {
		form = url.Values{}
	}
	return b.do(http.MethodPost, path, form, map[string]string{"Origin": b.base})
}

// follow is the GET a browser makes after a POST's redirect.
func (b *browser) follow(a answer) answer {
	b.t.Helper()
	require.Equal(b.t, http.StatusSeeOther, a.status, a.body)
	require.True(b.t, strings.HasPrefix(a.location, "/"), "redirect to a path of the server: %q", a.location)
	path, _, _ := strings.Cut(a.location, "#")
	return b.get(path)
}

var (
	rowRe   = regexp.MustCompile(`<tr data-id="([0-9a-f-]{36})" data-status="(\w+)">`)
	laneRe  = regexp.MustCompile(`<g class="lane" data-step="([^"]*)">`)
	barRe   = regexp.MustCompile(`<g class="bar-group" data-step="([^"]*)" data-phase="([^"]*)" data-outcome="([^"]*)">`)
	flashRe = regexp.MustCompile(`<div class="flash flash-(\w+)" role="status" id="flash">([^<]*)</div>`)
)

func rows(body string) map[string]string {
	out := map[string]string{}
	for _, m := range rowRe.FindAllStringSubmatch(body, -1) {
		out[m[1]] = m[2]
	}
	return out
}

func lanes(body string) []string {
	var out []string
	for _, m := range laneRe.FindAllStringSubmatch(body, -1) {
		out = append(out, m[1])
	}
	return out
}

func bars(body string) []string {
	var out []string
	for _, m := range barRe.FindAllStringSubmatch(body, -1) {
		out = append(out, m[1]+" "+m[2]+" "+m[3])
	}
	return out
}

func flashOf(t *testing.T, body string) (kind, msg string) {
	t.Helper()
	m := flashRe.FindStringSubmatch(body)
	require.NotNil(t, m, "no flash message in the page")
	return m[1], m[2]
}

// stepsOf is the steps a saga's timeline names, in the order it first
// names them: the lanes its picture must have.
func stepsOf(t *testing.T, db *sql.DB, id uuid.UUID) []string {
	t.Helper()
	in, err := mustOperator(t, db).Get(context.Background(), id)
	require.NoError(t, err)
	var out []string
	seen := map[string]bool{}
	for _, h := range in.History {
		if h.Step != "" && !seen[h.Step] {
			seen[h.Step] = true
			out = append(out, h.Step)
		}
	}
	return out
}

// The pages on a database filled by real runs: what they list, with the
// counts, filters and timelines of the database; a 400 or 404 page with a
// sentence for a bad filter or id; text from the database escaped.
func TestUIPagesOnARealRun(t *testing.T) {
	w := newUIWorld(t, uiConfig{})
	b := w.browser(t)

	// The sagas, counted by status, each linked to its page.
	home := b.get("/")
	require.Equal(t, http.StatusOK, home.status, home.body)
	assert.Equal(t, "text/html; charset=utf-8", home.header.Get("Content-Type"))
	assert.Contains(t, home.header.Get("Content-Security-Policy"), "default-src 'none'")
	assert.Equal(t, map[string]string{w.paid.String(): "completed", w.unpaid.String(): "compensated", w.parked.String(): "failed",
		w.running.String(): "running"}, rows(home.body))
	for status, n := range map[string]int{"running": 1, "compensating": 0, "completed": 1, "compensated": 1, "failed": 1} {
		assert.Regexp(t, `data-status="`+status+`"><span class="count-n">`+strconv.Itoa(n)+`</span>`, home.body, status)
	}
	assert.Regexp(t, `<span class="count-n">4</span><span class="count-label">all</span>`, home.body)
	assert.Contains(t, home.body, `href="/sagas/`+w.paid.String()+`"`)
	assert.Equal(t, rows(home.body), rows(b.get("/sagas").body))

	// Filters, as the sagas command takes them.
	assert.Equal(t, map[string]string{w.parked.String(): "failed"}, rows(b.get("/sagas?status=failed").body))
	assert.Equal(t, map[string]string{w.parked.String(): "failed", w.paid.String(): "completed"},
		rows(b.get("/sagas?status=failed&status=completed").body))
	assert.Equal(t, map[string]string{w.parked.String(): "failed", w.running.String(): "running"}, rows(b.get("/sagas?saga=job").body))
	jobOnly := b.get("/sagas?saga=job")
	assert.Regexp(t, `data-status="completed"><span class="count-n">0</span>`, jobOnly.body, "counts of the chosen saga")
	assert.Len(t, rows(b.get("/sagas?limit=2").body), 2)
	old := b.get("/sagas?older-than=1h")
	require.Equal(t, http.StatusOK, old.status)
	assert.Empty(t, rows(old.body))
	assert.Contains(t, old.body, "No saga matches these filters.")
	for q, want := range map[string]string{
		"status=bogus":     `status &#34;bogus&#34;: want one of running, compensating, completed, compensated, failed`,
		"limit=0":          "limit must be between 1 and 10000, got 0",
		"limit=many":       "limit &#34;many&#34; is not a whole number",
		"older-than=soon":  "older-than &#34;soon&#34; is not a duration",
		"older-than=-1m":   "older-than must not be negative",
		"limit=10001&x=1":  "limit must be between 1 and 10000",
		"status=failed,no": "status &#34;no&#34;",
	} {
		a := b.get("/sagas?" + q)
		assert.Equal(t, http.StatusBadRequest, a.status, q)
		assert.Contains(t, a.body, want, q)
	}

	// A saga's page: its facts, its timeline as a picture (a lane per
	// step, a bar per command) and as a table.
	for id, want := range map[uuid.UUID][]string{
		w.paid:   {"charge action ok", "confirm action ok"},
		w.unpaid: {"charge action failed", "order compensation ok"},
		w.parked: {"work action cancelled", "work compensation failed"},
	} {
		page := b.get("/sagas/" + id.String())
		require.Equal(t, http.StatusOK, page.status, page.body)
		assert.Equal(t, stepsOf(t, w.db, id), lanes(page.body), "one lane per step of %s", id)
		assert.Equal(t, want, bars(page.body), "bars of %s", id)
		assert.Contains(t, page.body, `id="timeline-table"`)
		assert.Contains(t, page.body, "time since the saga started (ms)")
	}
	paid := b.get("/sagas/" + w.paid.String())
	assert.Contains(t, paid.body, `<g class="event event-completed" data-kind="completed">`)
	assert.Contains(t, paid.body, `id="saga-status">completed</span>`)
	assert.Regexp(t, `id="retry" disabled`, paid.body, "a completed saga has nothing to retry")
	assert.Contains(t, paid.body, "No dead letter names this saga")
	unpaid := b.get("/sagas/" + w.unpaid.String())
	assert.Contains(t, unpaid.body, `event-compensated`)
	assert.Contains(t, unpaid.body, "reply_failed")
	running := b.get("/sagas/" + w.running.String())
	assert.Equal(t, []string{"work action open"}, bars(running.body), "a command not answered yet")
	assert.NotRegexp(t, `id="cancel" disabled`, running.body)

	// The parked saga: its failure reason and its dead letter, escaped.
	parked := b.get("/sagas/" + w.parked.String())
	assert.Contains(t, parked.body, `<g class="event event-failed" data-kind="failed">`)
	assert.Contains(t, parked.body, "cancelled by an operator: wrong customer")
	assert.Contains(t, parked.body, `id="dl-`+strconv.FormatInt(w.hostile, 10)+`"`, "the dead letter whose metadata names the saga")
	assert.NotContains(t, parked.body, `id="dl-`+strconv.FormatInt(w.lost, 10)+`"`)
	for _, page := range []answer{parked, b.get("/dead-letters"), b.get("/dead-letters?topic=jobs.undo")} {
		require.Equal(t, http.StatusOK, page.status)
		assert.NotContains(t, strings.ToLower(page.body), "<script", "no markup from the database, and no script of ours")
		assert.Contains(t, page.body, "&lt;script&gt;alert(1)&lt;/script&gt;")
		assert.Contains(t, page.body, "&lt;/td&gt;&lt;/table&gt;&lt;script&gt;alert(&#39;metadata&#39;)&lt;/script&gt;")
		assert.True(t, utf8.ValidString(page.body), "the page is UTF-8 whatever the payload holds")
		assert.NotContains(t, page.body, "\x00")
		assert.Contains(t, page.body, `\xff\xfe&lt;script&gt;`, "bytes that are not text are shown as escapes")
		assert.Contains(t, page.body, "bytes that are not UTF-8 text are shown as")
	}

	// Bad ids: a sentence, not a 500.
	for path, want := range map[string]struct {
		status int
		text   string
	}{
		"/sagas/not-a-uuid":                                          {400, "&#34;not-a-uuid&#34; is not a saga id"},
		"/sagas/" + uuid.NewString():                                 {404, "No saga has the id"},
		"/sagas/" + w.paid.String() + "?request=x":                   {400, "is not a request id"},
		"/sagas/" + w.paid.String() + "?request=" + uuid.NewString(): {404, "No request"},
		"/no/such/page":                                              {404, "There is no page at /no/such/page"},
		"/dead-letters?limit=0":                                      {400, "limit must be between 1 and 10000"},
		"/dead-letters?after=x":                                      {400, "after &#34;x&#34; is not a dead letter id"},
		"/consumers?stale=x":                                         {400, "stale &#34;x&#34; is not a positive duration"},
		"/consumers?stale=0s":                                        {400, "is not a positive duration"},
		"/sagas/%3Cscript%3Ealert(1)%3C":                             {400, "&#34;&lt;script&gt;alert(1)&lt;&#34; is not a saga id"},
		"/dead-letters/" + strconv.FormatInt(w.lost+1000, 10):        {404, "No dead letter has the id"},
	} {
		a := b.get(path)
		assert.Equal(t, want.status, a.status, path)
		assert.Contains(t, a.body, want.text, path)
		assert.Contains(t, a.body, `id="error-message"`, path)
	}

	// Dead letters: both, with reason, attempts, replayed or not; by topic;
	// a page at a time.
	dead := b.get("/dead-letters")
	require.Equal(t, http.StatusOK, dead.status)
	for _, id := range []int64{w.hostile, w.lost} {
		assert.Contains(t, dead.body, `id="dl-`+strconv.FormatInt(id, 10)+`" data-id="`+strconv.FormatInt(id, 10)+`" data-replayed="false"`)
	}
	assert.Contains(t, dead.body, "no consumer group subscribes to topic nobody.reads")
	assert.Contains(t, dead.body, `href="/sagas/`+w.parked.String()+`"`, "a dead letter links to its saga")
	lost := b.get("/dead-letters?topic=nobody.reads")
	assert.Contains(t, lost.body, `id="dl-`+strconv.FormatInt(w.lost, 10)+`"`)
	assert.NotContains(t, lost.body, `id="dl-`+strconv.FormatInt(w.hostile, 10)+`"`)
	first := b.get("/dead-letters?limit=1")
	assert.Contains(t, first.body, `href="/dead-letters?after=`, "a next page")
	assert.Contains(t, b.get("/dead-letters?topic=nobody.cares").body, "No dead letters on topic nobody.cares.")

	// Consumers: every group, running or not.
	cons := b.get("/consumers")
	require.Equal(t, http.StatusOK, cons.status)
	assert.Contains(t, cons.body, `<tr data-topic="payments.charge" data-group="payments.charge" data-state="running">`)
	assert.Contains(t, cons.body, `<tr data-topic="old.topic" data-group="old-group" data-state="never ran">`)
	assert.Contains(t, cons.body, `<tr data-topic="jobs.undo" data-group="jobs.undo" data-state="running">`)

	// Health, the stylesheet, and one log line per request at debug level.
	health := b.get("/healthz")
	assert.Equal(t, http.StatusOK, health.status)
	assert.Equal(t, "ok\n", health.body)
	css := b.get("/static/style.css")
	assert.Equal(t, http.StatusOK, css.status)
	assert.Contains(t, css.header.Get("Content-Type"), "text/css")
	assert.Equal(t, http.StatusNotFound, b.get("/static/").status, "no listing")
	assert.Equal(t, 1, strings.Count(w.log.String(), "uri=/healthz"), w.log.String())
	assert.Regexp(t, `level=DEBUG msg=request method=GET uri=/healthz status=200 bytes=3 took_ms=\S+ remote=127\.0\.0\.1:\d+`, w.log.String())
}

// The buttons: refused from another site (403, nothing done), a replay
// sent once and marked, retry and cancel carried out by the workers (or
// pending without them), each answered by a redirect and a message.
func TestUIButtons(t *testing.T) {
	w := newUIWorld(t, uiConfig{RequestWait: 500 * time.Millisecond})
	b := w.browser(t)
	ctx := context.Background()
	_, err := w.db.Exec(`INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ('nobody.reads', 'late-reader')`)
	require.NoError(t, err)
	replayPath := "/dead-letters/" + strconv.FormatInt(w.lost, 10) + "/replay"
	replayed := func() bool {
		dl, err := w.tr.DeadLetters(ctx, delivery.DeadLetterFilter{Topic: "nobody.reads"})
		require.NoError(t, err)
		require.Len(t, dl, 1)
		return dl[0].ReplayedAt != nil
	}
	queued := func() int {
		var n int
		require.NoError(t, w.db.QueryRow(`SELECT count(*) FROM pgsaga_queue WHERE topic = 'nobody.reads' AND consumer_group = 'late-reader'`).Scan(&n))
		return n
	}

	// From another site, or not saying where from: 403, nothing done.
	for name, header := range map[string]map[string]string{
		"no Origin":             {},
		"another origin":        {"Origin": "http://evil.example"},
		"same host, other port": {"Origin": "http://127.0.0.1:1"},
		"a cross-site fetch":    {"Origin": w.base, "Sec-Fetch-Site": "cross-site"},
		"a same-site fetch":     {"Sec-Fetch-Site": "same-site"},
		"a null origin":         {"Origin": "null"},
	} {
		a := b.do(http.MethodPost, replayPath, url.Values{}, header)
		assert.Equal(t, http.StatusForbidden, a.status, name)
		assert.Contains(t, a.body, "nothing was changed", name)
	}
	port := w.base[strings.LastIndex(w.base, ":")+1:]
	rebinding := b.do(http.MethodPost, replayPath, url.Values{}, map[string]string{"Origin": "http://evil.example:" + port, "Host": "evil.example:" + port})
	assert.Equal(t, http.StatusForbidden, rebinding.status, "a page of a site whose name points at this machine")
	assert.Contains(t, rebinding.body, "does not answer to the host name")
	for _, path := range []string{"/sagas/" + w.running.String() + "/cancel", "/sagas/" + w.parked.String() + "/retry"} {
		a := b.do(http.MethodPost, path, url.Values{}, map[string]string{"Origin": "http://evil.example"})
		assert.Equal(t, http.StatusForbidden, a.status, path)
	}
	assert.False(t, replayed())
	assert.Zero(t, queued())
	in, err := mustOperator(t, w.db).Get(ctx, w.running)
	require.NoError(t, err)
	assert.Equal(t, saga.StatusRunning, in.Status, "the refused cancel did nothing")
	rebound := b.do(http.MethodGet, "/sagas", nil, map[string]string{"Host": "evil.example"})
	assert.Equal(t, http.StatusForbidden, rebound.status, "a page asked for under another name is refused too")
	assert.NotContains(t, rebound.body, w.paid.String())
	samesite := b.do(http.MethodGet, "/dead-letters", nil, map[string]string{"Sec-Fetch-Site": "cross-site"})
	assert.Equal(t, http.StatusOK, samesite.status, "reading is not changing")

	// Replay: once, marked; the second is refused with why.
	a := b.press(replayPath, url.Values{"return": {"/dead-letters?topic=nobody.reads"}})
	assert.Equal(t, "/dead-letters?topic=nobody.reads#dl-"+strconv.FormatInt(w.lost, 10), a.location)
	page := b.follow(a)
	kind, msg := flashOf(t, page.body)
	assert.Equal(t, "ok", kind)
	assert.Equal(t, "Dead letter "+strconv.FormatInt(w.lost, 10)+" replayed (1 queue).", msg)
	assert.Contains(t, page.body, `data-id="`+strconv.FormatInt(w.lost, 10)+`" data-replayed="true"`)
	assert.Regexp(t, `<span class="badge replayed" title="[^"]+">replayed \S+ ago</span>`, page.body)
	assert.True(t, replayed())
	assert.Equal(t, 1, queued())
	again := b.get(strings.Split(a.location, "#")[0])
	assert.NotContains(t, again.body, `id="flash"`, "a flash message is shown once")

	a = b.press(replayPath, url.Values{"return": {"https://evil.example/"}})
	assert.Equal(t, "/dead-letters#dl-"+strconv.FormatInt(w.lost, 10), a.location, "redirects only within the server")
	kind, msg = flashOf(t, b.follow(a).body)
	assert.Equal(t, "error", kind)
	assert.Contains(t, msg, "not replayed: the dead letter was replayed already")
	assert.Equal(t, 1, queued(), "replayed exactly once")
	kind, msg = flashOf(t, b.follow(b.press("/dead-letters/999999/replay", nil)).body)
	assert.Equal(t, "error", kind)
	assert.Equal(t, "No dead letter has the id 999999: nothing was replayed.", msg)
	bad := b.press("/dead-letters/x/replay", nil)
	assert.Equal(t, http.StatusBadRequest, bad.status)
	assert.Contains(t, bad.body, "is not a dead letter id")
	forged := b.do(http.MethodGet, "/dead-letters", nil, map[string]string{"Cookie": "pgsaga_flash=eyJrIjoib2siLCJtIjoiaGkifQ.AAAA"})
	assert.NotContains(t, forged.body, `id="flash"`, "a flash message this server did not sign is not shown")

	// What a broker bridge received but could not queue: its button is
	// disabled and says why; pressed anyway, the replay is refused.
	garbled := message.NewMessage("garbled", []byte("\xff"))
	require.NoError(t, w.tr.StoreDeadLetter(ctx, "payments.commands", "pgsaga", transport.ReceiveHandler, garbled, "unreadable"))
	received, err := w.tr.DeadLetters(ctx, delivery.DeadLetterFilter{Topic: "payments.commands"})
	require.NoError(t, err)
	require.Len(t, received, 1)
	rid := strconv.FormatInt(received[0].ID, 10)
	list := b.get("/dead-letters?topic=payments.commands")
	assert.Regexp(t, `<button type="submit" class="btn btn-small replay" disabled title="[^"]*must be sent again[^"]*">Replay</button>`, list.body)
	kind, msg = flashOf(t, b.follow(b.press("/dead-letters/"+rid+"/replay", nil)).body)
	assert.Equal(t, "error", kind)
	assert.Contains(t, msg, "Dead letter "+rid+" not replayed: the dead letter cannot be replayed")

	// Cancel a running saga: the workers carry it out; its compensation is
	// refused, so it parks.
	a = b.press("/sagas/"+w.running.String()+"/cancel", url.Values{"reason": {"asked <i>twice</i>"}})
	require.Equal(t, http.StatusSeeOther, a.status, a.body)
	assert.Regexp(t, `^/sagas/`+w.running.String()+`\?request=[0-9a-f-]{36}$`, a.location)
	page = b.follow(a)
	kind, msg = flashOf(t, page.body)
	assert.Equal(t, "ok", kind, msg)
	assert.Regexp(t, `^Cancel done; the saga is (compensating|failed)\.$`, msg)
	assert.Contains(t, page.body, `data-outcome="done"`)
	assert.Contains(t, page.body, "asked &lt;i&gt;twice&lt;/i&gt;")
	waitStatus(t, w.jobs, w.running, saga.StatusFailed)

	// Retry the parked saga once the cause is fixed: it compensates.
	w.refuseUndo.Store(false)
	page = b.follow(b.press("/sagas/"+w.parked.String()+"/retry", nil))
	kind, msg = flashOf(t, page.body)
	assert.Equal(t, "ok", kind, msg)
	assert.Contains(t, msg, "Retry done; the saga is")
	waitStatus(t, w.jobs, w.parked, saga.StatusCompensated)
	page = b.get("/sagas/" + w.parked.String())
	assert.Equal(t, []string{"work action cancelled", "work compensation failed", "work compensation ok"}, bars(page.body))
	assert.Contains(t, page.body, `class="mark mark-retried"`)
	assert.Contains(t, page.body, `event-compensated`)

	// What the saga is in no state for is refused, with why.
	kind, msg = flashOf(t, b.follow(b.press("/sagas/"+w.parked.String()+"/retry", nil)).body)
	assert.Equal(t, "error", kind)
	assert.Contains(t, msg, "Retry refused:")
	kind, msg = flashOf(t, b.follow(b.press("/sagas/"+w.paid.String()+"/cancel", nil)).body)
	assert.Equal(t, "error", kind, "the order-payment workers refuse to cancel a completed saga")
	assert.Contains(t, msg, "Cancel refused:")
	a = b.press("/sagas/"+uuid.NewString()+"/retry", nil)
	assert.Equal(t, "/sagas", a.location)
	kind, msg = flashOf(t, b.follow(a).body)
	assert.Equal(t, "error", kind)
	assert.Contains(t, msg, "No saga has the id")
	assert.Equal(t, http.StatusBadRequest, b.press("/sagas/nope/cancel", nil).status)
	assert.Equal(t, http.StatusNotFound, b.get("/sagas/"+w.paid.String()+"/retry").status, "a button's address is no page")

	// With no worker running the request waits for one, and the page says
	// so and refreshes.
	waiting := w.start("waiting")
	require.NoError(t, w.jobs.Stop(context.Background()))
	a = b.press("/sagas/"+waiting.String()+"/cancel", nil)
	page = b.follow(a)
	kind, msg = flashOf(t, page.body)
	assert.Equal(t, "info", kind)
	assert.Contains(t, msg, "no worker has carried it out yet")
	assert.Contains(t, page.body, `data-outcome="pending"`)
	assert.Contains(t, page.body, `<meta http-equiv="refresh" content="2">`)
}

// The command: a bad address is a usage error (exit 2) before anything is
// opened; a port in use fails (exit 1); it says where it serves, logs one
// line per request with -v, and stops when its context ends (exit 0).
func TestUICommand(t *testing.T) {
	t.Setenv(envUIToken, testToken) // what an address off loopback needs besides
	for _, addr := range []string{"nonsense", "127.0.0.1:99999", "127.0.0.1:http", "bad host!:8080", ":", "127.0.0.1",
		"999.1.1.1:80", "256.0.0.1:8080", "1.2.3:80", "1.2.3.4.5:80", "[::1:8080"} {
		code, _, errOut := pgsaga(t, "ui", "--addr", addr, "--allow-host", "ui.example")
		assert.Equal(t, exitUsage, code, "%s: %s", addr, errOut)
		assert.Contains(t, errOut, fmt.Sprintf("--addr %q: ", addr))
	}
	code, _, _ := pgsaga(t, "ui", "extra")
	assert.Equal(t, exitUsage, code)
	t.Setenv(envUIToken, "")

	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	code, _, errOut := pgsaga(t, "ui", "--addr", busy.Addr().String())
	assert.Equal(t, exitFailed, code)
	assert.Contains(t, errOut, "cannot listen on "+busy.Addr().String())

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr testout.Buffer
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"ui", "--addr", "127.0.0.1:0", "-v"}, io.Discard, &stderr) }()
	base := servingAt(t, &stderr)
	for _, path := range []string{"/healthz", "/sagas", "/consumers"} {
		resp, err := http.Get(base + path)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode, path)
	}
	assert.Equal(t, 3, strings.Count(stderr.String(), "msg=request"), stderr.String())
	cancel()
	assert.Equal(t, exitOK, <-done, stderr.String())
	assert.Contains(t, stderr.String(), "pgsaga ui: stopped")
	_, err = http.Get(base + "/healthz")
	assert.Error(t, err, "nothing listens any more")
}

var servingRe = regexp.MustCompile(`pgsaga ui: serving (http://\S+)\n`)

// servingAt waits for the line saying where the view serves, and returns
// its address.
func servingAt(t *testing.T, out *testout.Buffer) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out.WaitFor(ctx, t, "pgsaga ui: serving http://")
	var m []string
	eventually(t, "the whole line", func() bool { m = servingRe.FindStringSubmatch(out.String()); return m != nil })
	assert.Equal(t, 1, strings.Count(out.String(), "pgsaga ui: serving"), "said once")
	return m[1]
}

// childArgs names the environment variable that makes the test binary
// run the program with these arguments (see TestMain).
const childArgs = "PGSAGA_TEST_CHILD_ARGS"

// SIGTERM stops the program gracefully: a request in progress (a Cancel
// waiting for a worker that does not run) is answered, then it exits 0.
func TestUIStopsGracefullyOnSIGTERM(t *testing.T) {
	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	jobs, start := jobSagaOn(t, db, &atomic.Bool{})
	id := start("in-flight")
	require.NoError(t, jobs.Stop(context.Background()))

	var out testout.Buffer
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), childArgs+"=ui --addr 127.0.0.1:0 -v")
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	base := servingAt(t, &out)

	type result struct {
		resp *http.Response
		err  error
	}
	answered := make(chan result, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, base+"/sagas/"+id.String()+"/cancel", strings.NewReader(""))
		req.Header.Set("Origin", base)
		client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
		resp, err := client.Do(req)
		answered <- result{resp, err}
	}()
	eventually(t, "the cancel is recorded: the request is in progress", func() bool {
		var n int
		require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1`, id).Scan(&n))
		return n > 0
	})
	require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
	r := <-answered
	require.NoError(t, r.err, "the request in progress is answered")
	_ = r.resp.Body.Close()
	assert.Equal(t, http.StatusSeeOther, r.resp.StatusCode)
	assert.NoError(t, <-exited, "exit status 0:\n%s", out.String())
	assert.Contains(t, out.String(), "pgsaga ui: stopped")
}

// sqlSaga is a saga instance a test writes with SQL: a timeline of one
// command sent, and for a failed one its failure.
type sqlSaga struct {
	Type, Step, MessageID, Detail, Reason, Correlation string
	Status                                             saga.Status
	// ID is the instance's id; a random one if unset.
	ID uuid.UUID
}

func insertSaga(t *testing.T, db *sql.DB, s sqlSaga) uuid.UUID {
	t.Helper()
	id := s.ID
	if id == uuid.Nil {
		id = uuid.New()
	}
	var finished *time.Time
	if s.Status.Terminal() {
		now := time.Now()
		finished = &now
	}
	_, err := db.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step, correlation_id, failure_reason, finished_at)
VALUES ($1, $2, 1, $3, '{"note": "written by a test"}', 0, NULLIF($4, ''), NULLIF($5, ''), $6)`,
		id, s.Type, string(s.Status), s.Correlation, s.Reason, finished)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO saga_history (saga_id, seq, kind, step, phase, attempt, message_id, detail) VALUES
($1, 1, 'started', NULL, NULL, NULL, NULL, 'trigger'),
($1, 2, 'sent', $2, 'action', 1, $3, $4)`, id, s.Step, s.MessageID, s.Detail)
	require.NoError(t, err)
	if s.Status == saga.StatusFailed {
		_, err = db.Exec(`INSERT INTO saga_history (saga_id, seq, kind, step, phase, attempt, message_id, detail) VALUES
($1, 3, 'reply_failed', $2, 'action', 1, $3, $4), ($1, 4, 'failed', $2, 'action', 1, NULL, $4)`, id, s.Step, s.MessageID, s.Reason)
		require.NoError(t, err)
	}
	return id
}

// sqlDeadLetter is a dead letter a test writes with SQL.
type sqlDeadLetter struct {
	UUID, Topic, Group, Reason string
	Payload                    []byte
	Metadata                   map[string]string
}

func insertDeadLetter(t *testing.T, db *sql.DB, d sqlDeadLetter) int64 {
	t.Helper()
	if d.UUID == "" {
		d.UUID = uuid.NewString()
	}
	md, err := json.Marshal(d.Metadata)
	require.NoError(t, err)
	var id int64
	require.NoError(t, db.QueryRow(`INSERT INTO pgsaga_dead_letters (uuid, topic, consumer_group, handler, payload, metadata, reason, attempts, created_at)
VALUES ($1, $2, $3, $3, $4, $5, $6, 3, clock_timestamp()) RETURNING id`, d.UUID, d.Topic, d.Group, d.Payload, string(md), d.Reason).Scan(&id))
	return id
}

// subscribe records group as a reader of topic, as a worker does.
func subscribe(t *testing.T, db *sql.DB, topic, group string) {
	t.Helper()
	_, err := db.Exec(`INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ($1, $2)`, topic, group)
	require.NoError(t, err)
}

func replayed(t *testing.T, db *sql.DB, id int64) bool {
	t.Helper()
	var at *time.Time
	require.NoError(t, db.QueryRow(`SELECT replayed_at FROM pgsaga_dead_letters WHERE id = $1`, id).Scan(&at))
	return at != nil
}

// requestsOf counts the retries and cancels asked for saga id.
func requestsOf(t *testing.T, db *sql.DB, id uuid.UUID) int {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1`, id).Scan(&n))
	return n
}

// Dead letters of 5 MB each: a listing, of the dead letters or of a
// saga's, reads and shows a bounded part of each (its size and a preview)
// however large they are; a dead letter's own page shows more of it, and
// its download gives the payload byte for byte.
func TestUIDeadLetterPayloads(t *testing.T) {
	db := testdb.Fresh(t)
	owner := insertSaga(t, db.SQL, sqlSaga{Type: "job", Step: "work", Status: saga.StatusFailed, Reason: "it broke"})
	const n, size = 10, 5 << 20
	fill := bytes.Repeat([]byte("0123456789abcdef"), size/16)
	payloads := make([][]byte, n)
	ids := make([]int64, n)
	for i := range payloads {
		p := slices.Clone(fill)
		copy(p, fmt.Sprintf(`{"dead": %d, "fill": "`, i))
		copy(p[size/8:], fmt.Sprintf("MIDDLE-%d", i))
		copy(p[size-16:], fmt.Sprintf("\xff\x00TAIL-%d", i))
		payloads[i] = p
		ids[i] = insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "big.topic", Group: "big.group", Reason: "too big to handle",
			Payload: p, Metadata: map[string]string{metadata.SagaID: owner.String()}})
	}
	// One whose metadata is too large for a listing to read.
	wide := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "wide.topic", Group: "wide.group", Reason: "too wide",
		Metadata: map[string]string{metadata.SagaID: owner.String(), "wide": strings.Repeat("w", delivery.DeadLetterListText)}})
	s := serveTestUI(t, db.URL, uiConfig{}, uiServing{})
	b := s.browser(t)

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	list := b.get("/dead-letters?topic=big.topic")
	runtime.ReadMemStats(&after)
	require.Equal(t, http.StatusOK, list.status, list.body)
	assert.Less(t, after.TotalAlloc-before.TotalAlloc, uint64(size), "the listing took less memory than one payload")
	sagaPage := b.get("/sagas/" + owner.String())
	require.Equal(t, http.StatusOK, sagaPage.status)
	for _, page := range []answer{list, sagaPage} {
		assert.Less(t, len(page.body), 256<<10, "a page of 10 dead letters of 5 MB")
		for i, id := range ids {
			dl := strconv.FormatInt(id, 10)
			assert.Contains(t, page.body, `id="dl-`+dl+`"`)
			assert.Contains(t, page.body, `href="/dead-letters/`+dl+`"`, "a link to the dead letter's page")
			assert.Contains(t, page.body, `href="/dead-letters/`+dl+`/payload"`, "a link to its payload")
			assert.Contains(t, page.body, "first 256 of 5,242,880 bytes")
			assert.Contains(t, page.body, fmt.Sprintf(`{&#34;dead&#34;: %d, &#34;fill&#34;: &#34;56789abcdef`, i), "a preview")
			assert.NotContains(t, page.body, fmt.Sprintf("MIDDLE-%d", i))
			assert.NotContains(t, page.body, fmt.Sprintf("TAIL-%d", i))
		}
	}

	assert.Contains(t, sagaPage.body, "1 dead letter searched had metadata too large to list (over 4,096 bytes), so whether they name this saga is not known")
	wideList := b.get("/dead-letters?topic=wide.topic")
	assert.Regexp(t, `<p class="hint">4,\d{3} bytes, too many to list: the dead letter&#39;s page shows them.</p>`, wideList.body)
	assert.NotContains(t, wideList.body, strings.Repeat("w", 100))
	widePage := b.get("/dead-letters/" + strconv.FormatInt(wide, 10))
	assert.Contains(t, widePage.body, strings.Repeat("w", delivery.DeadLetterListText), "its page shows all of its metadata")
	assert.Contains(t, widePage.body, `href="/sagas/`+owner.String()+`"`)

	// One dead letter: its page shows the first MiB; its download, all.
	dl := strconv.FormatInt(ids[3], 10)
	one := b.get("/dead-letters/" + dl)
	require.Equal(t, http.StatusOK, one.status, one.body)
	assert.Contains(t, one.body, "MIDDLE-3")
	assert.NotContains(t, one.body, "TAIL-3")
	assert.Contains(t, one.body, "first 1,048,576 of 5,242,880 bytes")
	assert.Contains(t, one.body, `href="/dead-letters/`+dl+`/payload"`)
	assert.Contains(t, one.body, `action="/dead-letters/`+dl+`/replay"`, "its Replay button")
	assert.Contains(t, one.body, "too big to handle")
	assert.Less(t, len(one.body), 2<<20)
	got := b.get("/dead-letters/" + dl + "/payload")
	require.Equal(t, http.StatusOK, got.status)
	assert.Equal(t, "application/octet-stream", got.header.Get("Content-Type"))
	assert.Equal(t, `attachment; filename="dead-letter-`+dl+`.bin"`, got.header.Get("Content-Disposition"))
	assert.Equal(t, "nosniff", got.header.Get("X-Content-Type-Options"))
	assert.Equal(t, strconv.Itoa(size), got.header.Get("Content-Length"))
	assert.True(t, got.body == string(payloads[3]), "the payload byte for byte (%d bytes, want %d)", len(got.body), size)

	// A preview cut within a character leaves it out; a reason cut says so.
	accents := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "cut.topic", Group: "cut.group", Reason: strings.Repeat("r", 5000),
		Payload: []byte(strings.Repeat("a", delivery.DeadLetterPreviewBytes-1) + "é and more")})
	cut := b.get("/dead-letters?topic=cut.topic")
	assert.Contains(t, cut.body, `id="dl-`+strconv.FormatInt(accents, 10)+`"`)
	assert.Contains(t, cut.body, strings.Repeat("a", delivery.DeadLetterPreviewBytes-1)+"</pre>")
	assert.NotContains(t, cut.body, "not UTF-8")
	assert.NotContains(t, cut.body, `\x`)
	assert.Contains(t, cut.body, "The first 4,096 of 5,000 characters: the dead letter&#39;s page has all of it.")
	assert.NotContains(t, cut.body, strings.Repeat("r", 4097))
	assert.Contains(t, b.get("/dead-letters/"+strconv.FormatInt(accents, 10)).body, strings.Repeat("r", 5000))

	// A small one is shown whole, as JSON.
	small := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "small.topic", Group: "small.group", Reason: "refused",
		Payload: []byte(`{"order":"o-1","cents":500}`)})
	page := b.get("/dead-letters/" + strconv.FormatInt(small, 10))
	require.Equal(t, http.StatusOK, page.status)
	assert.Contains(t, page.body, "{\n  &#34;order&#34;: &#34;o-1&#34;,\n  &#34;cents&#34;: 500\n}")
	assert.Contains(t, page.body, "27 bytes")

	for path, want := range map[string]struct {
		status int
		text   string
	}{
		"/dead-letters/999999999":         {404, "No dead letter has the id 999999999"},
		"/dead-letters/999999999/payload": {404, "No dead letter has the id 999999999"},
		"/dead-letters/x":                 {400, "&#34;x&#34; is not a dead letter id"},
		"/dead-letters/0/payload":         {400, "&#34;0&#34; is not a dead letter id"},
		"/dead-letters/-1":                {400, "&#34;-1&#34; is not a dead letter id"},
	} {
		a := b.get(path)
		assert.Equal(t, want.status, a.status, path)
		assert.Contains(t, a.body, want.text, path)
	}
}

// unsafeText finds what a page must not hold: invalid UTF-8, and control
// and bidi characters (besides tab and line ends).
var unsafeText = regexp.MustCompile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\u0080-\u009f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")

// Text from the database reaches the pages without its control and bidi
// characters, shown as \x1b, \x07, \u202e...: in tables, headings, the
// timeline picture, a dead letter's page, a message after a button, an
// error page.
func TestUIEscapesControlCharacters(t *testing.T) {
	db := testdb.Fresh(t)
	hostile := func(s string) string { return s + "\x1b[31m red\a \u202etxt.exe\u009b2J \u2066x\u2069\u200f\x7f" }
	const shown = `\x1b[31m red\x07 \u202etxt.exe\u009b2J \u2066x\u2069\u200f\x7f`
	id := insertSaga(t, db.SQL, sqlSaga{Type: hostile("job"), Step: hostile("work"), MessageID: hostile("msg"), Detail: hostile("detail"),
		Reason: hostile("reason"), Correlation: hostile("corr"), Status: saga.StatusFailed})
	dl := insertDeadLetter(t, db.SQL, sqlDeadLetter{UUID: hostile("uuid"), Topic: hostile("topic"), Group: hostile("group"), Reason: hostile("why"),
		Payload: []byte(hostile("payload")), Metadata: map[string]string{metadata.SagaID: id.String(), hostile("key"): hostile("value")}})
	subscribe(t, db.SQL, hostile("topic"), hostile("other"))
	s := serveTestUI(t, db.URL, uiConfig{}, uiServing{})
	b := s.browser(t)
	dlPath := "/dead-letters/" + strconv.FormatInt(dl, 10)

	pages := map[string]answer{}
	for _, path := range []string{"/sagas", "/sagas?saga=" + url.QueryEscape(hostile("job")), "/sagas/" + id.String(), "/dead-letters", dlPath, "/consumers"} {
		pages[path] = b.get(path)
		assert.Equal(t, http.StatusOK, pages[path].status, path)
	}
	pages["a message after a button"] = b.follow(b.press(dlPath+"/replay", url.Values{"return": {dlPath}}))
	_, msg := flashOf(t, pages["a message after a button"].body)
	assert.Contains(t, msg, "group"+shown)
	pages["an error page"] = b.get("/no-page-" + url.PathEscape(hostile("here")))
	assert.Equal(t, http.StatusNotFound, pages["an error page"].status)
	for name, page := range pages {
		assert.True(t, utf8.ValidString(page.body), name)
		assert.Empty(t, unsafeText.FindAllString(page.body, -1), name)
		assert.Contains(t, page.body, shown, name)
	}
	sagaPage := pages["/sagas/"+id.String()].body
	for _, what := range []string{"job", "work", "msg", "detail", "reason", "corr"} {
		assert.Contains(t, sagaPage, what+shown, what)
	}
	assert.Regexp(t, `<text class="lane-label" [^>]*>work\\x1b`, sagaPage, "the timeline picture's lane")
	assert.Contains(t, sagaPage, "<title>Saga "+id.String()+" · pgsaga</title>")
	for _, what := range []string{"uuid", "topic", "group", "why", "payload", "key", "value"} {
		assert.Contains(t, pages[dlPath].body, what+shown, what)
	}
	assert.Contains(t, pages["/dead-letters"].body, "payload"+shown)
	assert.Contains(t, pages["/consumers"].body, "other"+shown)
	assert.Contains(t, pages["/sagas?saga="+url.QueryEscape(hostile("job"))].body, "<h1>Sagas <span class=\"muted\">· job"+shown)
}

// Input that is not text (bytes that are not UTF-8, a NUL), or not what a
// filter or an id takes, is a 400 with a sentence that does not repeat the
// bytes, and changes nothing.
func TestUIBadInput(t *testing.T) {
	db := testdb.Fresh(t)
	id := insertSaga(t, db.SQL, sqlSaga{Type: "job", Step: "work", Status: saga.StatusRunning})
	dl := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "t", Group: "g", Reason: "r"})
	subscribe(t, db.SQL, "t", "g")
	s := serveTestUI(t, db.URL, uiConfig{}, uiServing{})
	b := s.browser(t)
	for _, path := range []string{
		"/sagas?saga=%ff", "/sagas?saga=a%00b", "/sagas?status=%ff", "/sagas?status=running,%ff", "/sagas?older-than=%ff", "/sagas?%ff=1",
		"/sagas?saga=%zz", "/sagas?limit=99999999999999999999", "/sagas?limit=-1", "/sagas?older-than=99999999999999h",
		"/dead-letters?topic=%ff", "/dead-letters?topic=%00", "/dead-letters?after=-1", "/dead-letters?after=99999999999999999999",
		"/dead-letters?limit=%ff", "/dead-letters/%ff", "/dead-letters/99999999999999999999", "/dead-letters/1%ff/payload",
		"/consumers?stale=%ff", "/consumers?stale=99999999999999h", "/sagas/" + id.String() + "?request=%ff", "/sagas/%ff",
	} {
		a := b.get(path)
		assert.Equal(t, http.StatusBadRequest, a.status, path)
		assert.True(t, utf8.ValidString(a.body), path)
		assert.NotContains(t, a.body, "\x00", path)
		assert.Contains(t, a.body, `id="error-message"`, path)
	}
	for _, form := range []url.Values{{"reason": {"\xff"}}, {"reason": {"a\x00b"}}, {"\xff": {"x"}}} {
		for _, path := range []string{"/sagas/" + id.String() + "/cancel", "/sagas/" + id.String() + "/retry"} {
			a := b.press(path, form)
			assert.Equal(t, http.StatusBadRequest, a.status, "%s %q", path, form)
			assert.True(t, utf8.ValidString(a.body))
		}
	}
	a := b.press("/dead-letters/"+strconv.FormatInt(dl, 10)+"/replay", url.Values{"return": {"/dead-letters?topic=\xff"}})
	assert.Equal(t, http.StatusBadRequest, a.status)
	assert.Zero(t, requestsOf(t, db.SQL, id), "nothing was asked")
	assert.False(t, replayed(t, db.SQL, dl), "nothing was replayed")
}

// The sagas page finds a saga by its name and business key (the key its
// trigger gave), and pages through a listing: every saga once, with the
// filters kept; a bad page or search is a 400, an unknown key a 404.
func TestUIFindsASagaByItsKeyAndPages(t *testing.T) {
	db := testdb.Fresh(t)
	want := insertSaga(t, db.SQL, sqlSaga{Type: "order", Step: "charge", Status: saga.StatusRunning, ID: saga.ID("order", "o-42")})
	for range 4 {
		insertSaga(t, db.SQL, sqlSaga{Type: "order", Step: "charge", Status: saga.StatusRunning})
	}
	insertSaga(t, db.SQL, sqlSaga{Type: "other", Step: "x", Status: saga.StatusRunning})
	s := serveTestUI(t, db.URL, uiConfig{}, uiServing{})
	b := s.browser(t)

	a := b.get("/sagas/find?saga=order&key=o-42")
	require.Equal(t, http.StatusSeeOther, a.status, a.body)
	assert.Equal(t, "/sagas/"+want.String(), a.location)
	a = b.get("/sagas/find?saga=order&key=o-43")
	assert.Equal(t, http.StatusNotFound, a.status)
	assert.Contains(t, a.body, "No saga order has the business key &#34;o-43&#34;.")
	assert.Equal(t, http.StatusBadRequest, b.get("/sagas/find?saga=order").status)
	page := b.get("/sagas")
	assert.Contains(t, page.body, `action="/sagas/find"`, "the sagas page has the search")

	seen := map[string]bool{}
	path := "/sagas?saga=order&limit=2"
	for pages := 0; path != ""; pages++ {
		require.Less(t, pages, 4, "three pages of two at most")
		a := b.get(path)
		require.Equal(t, http.StatusOK, a.status, a.body)
		for id := range rows(a.body) {
			assert.False(t, seen[id], "saga %s on two pages", id)
			seen[id] = true
		}
		path = ""
		if m := regexp.MustCompile(`href="([^"]*)" id="next-page"`).FindStringSubmatch(a.body); m != nil {
			path = html.UnescapeString(m[1])
			assert.Contains(t, path, "saga=order", "the filters are kept")
		}
	}
	assert.Len(t, seen, 5, "every saga of order once")
	assert.Equal(t, http.StatusBadRequest, b.get("/sagas?after=x&after-at=y").status)
}
