package main

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/saga"
)

// chromium is the browser the end-to-end test drives: Debian's chromium.
// Without it the test skips, and fails under CI, which installs it.
func chromium(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat("/usr/bin/chromium"); err == nil {
		return "/usr/bin/chromium"
	}
	if p, err := exec.LookPath("chromium"); err == nil {
		return p
	}
	const why = "chromium is not installed; apt-get install -y chromium (CI installs it)"
	if os.Getenv("CI") != "" {
		t.Fatal(why)
	}
	t.Skip(why)
	return ""
}

// screenshotDir is where the browser test writes its screenshots: docs/
// with PGSAGA_UPDATE_SCREENSHOTS=1 (the README shows them), else a
// temporary directory, so that a test run changes nothing in the tree.
func screenshotDir(t *testing.T) string {
	if os.Getenv("PGSAGA_UPDATE_SCREENSHOTS") == "1" {
		return filepath.Join("..", "..", "docs")
	}
	return t.TempDir()
}

// The web view in a real browser (headless chromium, driven over the
// DevTools protocol), on a database filled by real runs, served as exposed
// to other machines (`--addr 0.0.0.0:port --allow-host ui.test`, a user
// and password) though it listens on 127.0.0.1, where chromium finds
// ui.test and evil.test. The operator logs in, filters the sagas page by
// status, clicks through to a saga whose timeline picture has a lane per
// step and a bar per command, replays a dead letter with the Replay button
// (the page says so and marks it), opens the consumers page; a full-page
// screenshot of each. Then the pages of a hostile site, in the same
// browser: one of another origin (fetching a page, posting retry, cancel
// and replay with the browser's credentials, submitting a form), and one
// whose name was pointed at the view's address after it loaded (DNS
// rebinding), doing the same from what the browser takes for the view's
// origin. They read nothing and change nothing.
func TestUIInABrowser(t *testing.T) {
	exe := chromium(t)
	// The rebound page is served by the view's listener, under evil.test:
	// the page the hostile site served before its name pointed here.
	rebound := func(ui http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasPrefix(r.Host, "evil.test:") && r.URL.Path == "/rebound" {
				hostilePage(w, r)
				return
			}
			ui.ServeHTTP(w, r)
		})
	}
	w := newUIWorld(t, uiConfig{Auth: loginFrom(t, map[string]string{envUIUser: "operator", envUIPassword: testPassword})},
		uiServing{Allow: []string{"ui.test"}, Wrap: rebound})
	_, err := w.db.Exec(`INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ('nobody.reads', 'late-reader')`)
	require.NoError(t, err)
	hostileSite := httptest.NewServer(http.HandlerFunc(hostilePage))
	defer hostileSite.Close()
	evil := "http://evil.test:" + hostileSite.URL[strings.LastIndex(hostileSite.URL, ":")+1:]
	shots := screenshotDir(t)

	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(exe),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("force-color-profile", "srgb"),
		chromedp.Flag("host-resolver-rules", "MAP ui.test 127.0.0.1, MAP evil.test 127.0.0.1"),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1360, 900),
	)
	defer cancelAlloc()
	ctx, cancelTab := chromedp.NewContext(alloc)
	defer cancelTab()
	require.NoError(t, chromedp.Do(ctx), "starting chromium") // the browser lives as long as ctx

	// step runs actions with a bound, naming what it was doing if it fails.
	step := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		require.NoError(t, chromedp.Do(sctx, actions...), what)
	}
	attrs := func(sel, name string) []string {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		nodes, err := chromedp.Run(sctx, chromedp.Nodes(chromedp.CSSAll(sel), chromedp.AtLeast(0)))
		require.NoError(t, err, sel)
		var out []string
		for _, n := range nodes {
			out = append(out, n.AttributeValue(name))
		}
		return out
	}
	text := func(sel string) string {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		s, err := chromedp.Run(sctx, chromedp.Text(chromedp.CSS(sel)))
		require.NoError(t, err, sel)
		return strings.TrimSpace(s)
	}
	location := func() string {
		t.Helper()
		loc, err := chromedp.Run(ctx, chromedp.Location())
		require.NoError(t, err)
		return strings.TrimPrefix(loc, w.base)
	}
	screenshot := func(name string) {
		t.Helper()
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		png, err := chromedp.Run(sctx, chromedp.FullScreenshot(100))
		require.NoError(t, err, name)
		require.NoError(t, os.WriteFile(filepath.Join(shots, name), png, 0o644))
	}

	// Without the login: nothing.
	_, err = chromedp.Run(ctx, chromedp.NavigateResponse(w.base+"/sagas"))
	assert.ErrorContains(t, err, "net::ERR_INVALID_AUTH_CREDENTIALS", "a 401, and no login to give (headless chromium has no prompt)")
	assert.Empty(t, attrs("#sagas tbody tr", "data-id"))

	// Logging in (the credentials in the address, as the prompt would take
	// them; chromium keeps them for the site), then the sagas, then only
	// the compensated ones.
	step("logging in and opening the sagas page",
		chromedp.Navigate("http://operator:"+testPassword+"@ui.test:"+w.port+"/sagas"), chromedp.WaitVisible(chromedp.ID("sagas")))
	assert.Equal(t, "/sagas", location())
	assert.ElementsMatch(t, []string{w.paid.String(), w.unpaid.String(), w.parked.String(), w.running.String()},
		attrs("#sagas tbody tr", "data-id"))
	screenshot("ui-sagas.png")
	step("filtering by status",
		chromedp.Click(chromedp.CSS(`input[name="status"][value="compensated"]`)),
		chromedp.Click(chromedp.ID("apply-filters")),
		chromedp.WaitVisible(chromedp.CSS(`a.count.status-compensated.selected`)))
	assert.Equal(t, "/sagas?status=compensated&saga=&older-than=&limit=100", location())
	assert.Equal(t, []string{w.unpaid.String()}, attrs("#sagas tbody tr", "data-id"))
	assert.Equal(t, []string{"compensated"}, attrs("#sagas tbody tr", "data-status"))

	// Through to the saga: its timeline picture.
	step("opening the compensated saga",
		chromedp.Click(chromedp.CSS(`#sagas a[href="/sagas/`+w.unpaid.String()+`"]`)),
		chromedp.WaitVisible(chromedp.ID("timeline")))
	assert.Equal(t, "/sagas/"+w.unpaid.String(), location())
	assert.Equal(t, "compensated", text("#saga-status"))
	assert.Equal(t, stepsOf(t, w.db, w.unpaid), attrs("#timeline g.lane", "data-step"), "one lane per step")
	assert.Equal(t, []string{"charge", "order"}, attrs("#timeline g.bar-group", "data-step"))
	assert.Equal(t, []string{"action", "compensation"}, attrs("#timeline g.bar-group", "data-phase"))
	assert.Equal(t, []string{"failed", "ok"}, attrs("#timeline g.bar-group", "data-outcome"))
	assert.Equal(t, []string{"started", "compensated"}, attrs("#timeline g.event", "data-kind"))
	assert.NotEmpty(t, attrs("#timeline .tick-label", "x"), "a time axis")
	screenshot("ui-saga.png")

	// Dead letters: replay the one nobody read, now that a group reads it.
	lost := strconv.FormatInt(w.lost, 10)
	step("opening the dead letters",
		chromedp.Click(chromedp.CSS(`header nav a[href="/dead-letters"]`)),
		chromedp.WaitVisible(chromedp.ID("dead-letters")))
	assert.Subset(t, attrs("#dead-letters tbody.dl", "data-id"), []string{strconv.FormatInt(w.hostile, 10), lost})
	assert.Equal(t, []string{"false"}, attrs("#dl-"+lost, "data-replayed"))
	step("replaying a dead letter",
		chromedp.Click(chromedp.CSS("#dl-"+lost+" button.replay")),
		chromedp.WaitVisible(chromedp.ID("flash")))
	assert.Equal(t, "Dead letter "+lost+" replayed (1 queue).", text("#flash"))
	assert.Equal(t, []string{"true"}, attrs("#dl-"+lost, "data-replayed"))
	assert.Regexp(t, `^replayed \S+ ago$`, text("#dl-"+lost+" .badge.replayed"))
	assert.Equal(t, []string{""}, attrs("#dl-"+lost+" button.replay[disabled]", "disabled"), "replayed once: its button is off")
	var replayedAt *time.Time
	require.NoError(t, w.db.QueryRow(`SELECT replayed_at FROM pgsaga_dead_letters WHERE id = $1`, w.lost).Scan(&replayedAt))
	assert.NotNil(t, replayedAt)
	screenshot("ui-dead-letters.png")

	// The consumer groups.
	step("opening the consumers",
		chromedp.Click(chromedp.CSS(`header nav a[href="/consumers"]`)),
		chromedp.WaitVisible(chromedp.ID("consumers")))
	groups := attrs("#consumers tbody tr", "data-group")
	states := attrs("#consumers tbody tr", "data-state")
	require.Len(t, states, len(groups))
	state := map[string]string{}
	for i, g := range groups {
		state[g] = states[i]
	}
	assert.Equal(t, "running", state["payments.charge"])
	assert.Equal(t, "never ran", state["old-group"])
	screenshot("ui-consumers.png")

	// The hostile pages. What they aim at: cancel the running saga, retry
	// the parked one, replay the dead letter not replayed yet.
	var requestsBefore int
	require.NoError(t, w.db.QueryRow(`SELECT count(*) FROM saga_requests`).Scan(&requestsBefore))
	unchanged := func(what string) {
		t.Helper()
		var n int
		require.NoError(t, w.db.QueryRow(`SELECT count(*) FROM saga_requests`).Scan(&n))
		assert.Equal(t, requestsBefore, n, "%s: nothing was asked", what)
		assert.False(t, replayed(t, w.db, w.hostile), "%s: nothing was replayed", what)
		in, err := mustOperator(t, w.db).Get(context.Background(), w.running)
		require.NoError(t, err)
		assert.Equal(t, saga.StatusRunning, in.Status, what)
	}
	targets := url.Values{"cancel": {"/sagas/" + w.running.String() + "/cancel"}, "retry": {"/sagas/" + w.parked.String() + "/retry"},
		"replay": {"/dead-letters/" + strconv.FormatInt(w.hostile, 10) + "/replay"}}
	for name, page := range map[string]string{
		"a page of another site":             evil + "/?ui=" + url.QueryEscape(w.base) + "&" + targets.Encode(),
		"a page whose name was rebound here": "http://evil.test:" + w.port + "/rebound?" + targets.Encode(),
	} {
		step(name, chromedp.Navigate(page), chromedp.WaitVisible(chromedp.ID("done")))
		got := text("#out")
		assert.Contains(t, got, "read: ", name)
		for _, secret := range []string{w.paid.String(), w.running.String(), w.parked.String(), testWhere, "Sagas"} {
			assert.NotContains(t, got, secret, "%s: nothing was read", name)
		}
		unchanged(name)
	}
	// A form of another site, submitted: the browser sends the operator's
	// credentials with it, but not from a page of ui.test.
	step("a form of another site",
		chromedp.Navigate(evil+"/form?ui="+url.QueryEscape(w.base)+"&"+targets.Encode()),
		chromedp.WaitVisible(chromedp.ID("error-message")))
	assert.Contains(t, text("#error-message"), "nothing was changed")
	unchanged("a form of another site")
}

// hostilePage is what a hostile site serves: a page whose script reads the
// view's sagas page and presses its buttons (the addresses in its query),
// asking the browser to send its credentials, and says what it got; at
// /form, a form that posts a cancel as soon as it loads.
func hostilePage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	if r.URL.Path == "/form" {
		fmt.Fprintf(w, `<!doctype html><form id="f" method="post" action="%s%s"><input name="reason" value="attack"></form>
<script>document.getElementById("f").submit()</script>`, html.EscapeString(q.Get("ui")), html.EscapeString(q.Get("cancel")))
		return
	}
	fmt.Fprintf(w, `<!doctype html><pre id="out"></pre><script>
const ui = %q, posts = {cancel: %q, retry: %q, replay: %q};
(async () => {
  const lines = [];
  try {
    const r = await fetch(ui + "/sagas", {credentials: "include"});
    lines.push("read: " + r.status + " " + await r.text());
  } catch (e) { lines.push("read: refused, " + e); }
  for (const [name, path] of Object.entries(posts)) {
    try {
      const r = await fetch(ui + path, {method: "POST", mode: "no-cors", credentials: "include", body: new URLSearchParams({reason: "attack"})});
      lines.push(name + ": " + r.type + " " + r.status);
    } catch (e) { lines.push(name + ": refused, " + e); }
  }
  document.getElementById("out").textContent = lines.join("\n");
  const done = document.createElement("p");
  done.id = "done";
  document.body.append(done);
})();
</script>`, q.Get("ui"), q.Get("cancel"), q.Get("retry"), q.Get("replay"))
}
