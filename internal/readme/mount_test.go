package readme

import (
	"bufio"
	"context"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// chromium is the browser the test drives: Debian's chromium. Without it
// the test skips, and fails under CI, which installs it.
func chromium(t *testing.T) string {
	t.Helper()
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

// The web view mounted in a team's admin server (docs/examples/admin),
// built in a module of its own, under /admin/sagas/ behind that server's
// own login, driven by a real browser: the view is out of reach without
// a session; signed in, the operator lists the sagas, opens one through
// its link, presses Cancel, and the page says so; every page, link and
// stylesheet stays under the prefix.
func TestTheWebViewMountsUnderAPrefixInAModuleOfItsOwn(t *testing.T) {
	t.Parallel()
	exe := chromium(t)
	gobin, root := goAndRoot(t)
	code, err := os.ReadFile(filepath.Join(root, "docs", "examples", "admin", "main.go"))
	require.NoError(t, err)
	dir := userModule(t, map[string]string{"main.go": string(code)})
	runGo(t, gobin, dir, nil, "build", "-o", "admin", ".")

	db := testdb.Fresh(t)
	id := uuid.New()
	_, err = db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step)
VALUES ($1, 'order', 1, 'running', '{}', 0)`, id)
	require.NoError(t, err)
	_, err = db.SQL.Exec(`INSERT INTO saga_history (saga_id, seq, kind, detail) VALUES ($1, 1, 'started', 'trigger')`, id)
	require.NoError(t, err)

	const password = "correct-horse-battery-staple-9"
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	server := exec.CommandContext(ctx, filepath.Join(dir, "admin"))
	server.Env = append(os.Environ(), "DATABASE_URL="+db.URL, "ADMIN_PASSWORD="+password, "ADMIN_ADDR=127.0.0.1:0")
	stdout, err := server.StdoutPipe()
	require.NoError(t, err)
	server.Stderr = os.Stderr
	require.NoError(t, server.Start())
	t.Cleanup(func() { stop(); _ = server.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	require.NoError(t, err, "the server says where it serves")
	view := strings.TrimSpace(strings.TrimPrefix(line, "admin: serving "))
	require.True(t, strings.HasSuffix(view, "/admin/sagas/"), line)
	base := strings.TrimSuffix(view, "/admin/sagas/")

	// Without a session, the view is out of reach: the team's login.
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for _, path := range []string{"/admin/sagas/", "/admin/sagas/sagas/" + id.String(), "/admin/sagas/static/style.css"} {
		resp, err := noRedirect.Get(base + path)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusSeeOther, resp.StatusCode, path)
		assert.Equal(t, "/login", resp.Header.Get("Location"), path)
	}

	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(exe), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck, chromedp.Flag("disable-dev-shm-usage", true), chromedp.UserDataDir(t.TempDir()))
	defer cancelAlloc()
	tab, cancelTab := chromedp.NewContext(alloc)
	defer cancelTab()
	require.NoError(t, chromedp.Do(tab), "starting chromium") // the browser lives as long as tab
	step := func(what string, actions ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, cancel := context.WithTimeout(tab, 30*time.Second)
		defer cancel()
		require.NoError(t, chromedp.Do(sctx, actions...), what)
	}
	location := func() string {
		t.Helper()
		loc, err := chromedp.Run(tab, chromedp.Location())
		require.NoError(t, err)
		return strings.TrimPrefix(loc, base)
	}
	text := func(sel string) string {
		t.Helper()
		sctx, cancel := context.WithTimeout(tab, 30*time.Second)
		defer cancel()
		s, err := chromedp.Run(sctx, chromedp.Text(chromedp.CSS(sel)))
		require.NoError(t, err, sel)
		return strings.TrimSpace(s)
	}

	step("opening the view, sent to the team's login", chromedp.Navigate(view), chromedp.WaitVisible(chromedp.ID("password")))
	assert.Equal(t, "/login", location())
	step("signing in",
		chromedp.SendKeys(chromedp.ID("password"), password), chromedp.Click(chromedp.ID("sign-in")),
		chromedp.WaitVisible(chromedp.ID("sagas")))
	assert.Equal(t, "/admin/sagas/", location())
	sheets, err := chromedp.Run(tab, chromedp.Evaluate[float64](`[...document.styleSheets].filter(s => s.href.includes("/admin/sagas/static/") && s.cssRules.length > 0).length`))
	require.NoError(t, err)
	assert.Equal(t, 1.0, sheets, "the view's stylesheet, under the prefix, loaded")

	step("opening the saga through its link",
		chromedp.Click(chromedp.CSS(`#sagas a[href="/admin/sagas/sagas/`+id.String()+`"]`)), chromedp.WaitVisible(chromedp.ID("timeline")))
	assert.Equal(t, "/admin/sagas/sagas/"+id.String(), location())
	assert.Equal(t, "running", text("#saga-status"))
	step("pressing Cancel",
		chromedp.SendKeys(chromedp.CSS(`input[name="reason"]`), "the customer called"), chromedp.Click(chromedp.ID("cancel")),
		chromedp.WaitVisible(chromedp.ID("flash")))
	assert.True(t, strings.HasPrefix(location(), "/admin/sagas/sagas/"+id.String()+"?request="), location())
	assert.Contains(t, text("#flash"), "Cancel requested")
	var asked int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM saga_requests WHERE saga_id = $1 AND kind = 'cancel'`, id).Scan(&asked))
	assert.Equal(t, 1, asked, "the press reached the database, once")
}
