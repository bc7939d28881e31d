package main

import (
	"context"
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
// DevTools protocol), on a database filled by real runs: the sagas page
// filtered by status, a click through to a saga whose timeline picture has
// a lane per step and a bar per command, a dead letter replayed with the
// Replay button (the page says so and marks it), the consumers page. It
// takes a full-page screenshot of each page.
func TestUIInABrowser(t *testing.T) {
	exe := chromium(t)
	w := newUIWorld(t, uiConfig{})
	_, err := w.db.Exec(`INSERT INTO pgsaga_subscriptions (topic, consumer_group) VALUES ('nobody.reads', 'late-reader')`)
	require.NoError(t, err)
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

	// The sagas, then only the compensated ones.
	step("opening the sagas page", chromedp.Navigate(w.base+"/sagas"), chromedp.WaitVisible(chromedp.ID("sagas")))
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
}
