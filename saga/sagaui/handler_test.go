package sagaui_test

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testpg"
	"github.com/pgsaga/pgsaga/saga"
	"github.com/pgsaga/pgsaga/saga/sagaui"
)

func TestMain(m *testing.M) { testpg.Main(m) }

// view serves the web view mounted at prefix of a fresh database holding
// one running saga, and returns the server and the saga's id.
func view(t *testing.T, prefix string, hosts ...string) (*httptest.Server, uuid.UUID) {
	t.Helper()
	db := testdb.Fresh(t)
	id := uuid.New()
	_, err := db.SQL.Exec(`INSERT INTO saga_instances (id, saga_type, definition_version, status, data, current_step)
VALUES ($1, 'order', 1, 'running', '{}', 0)`, id)
	require.NoError(t, err)
	client, err := saga.NewClientFromDB(db.SQL, saga.ClientConfig{Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	ui, err := sagaui.New(sagaui.Config{Client: client, Prefix: prefix, Hosts: hosts, RequestWait: 1})
	require.NoError(t, err)
	mux := http.NewServeMux()
	mux.Handle(prefix+"/", ui)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, id
}

type reply struct {
	status   int
	body     string
	location string
}

func get(t *testing.T, url string, header ...string) reply {
	t.Helper()
	return do(t, http.MethodGet, url, "", header...)
}

func do(t *testing.T, method, url, form string, header ...string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(form))
	require.NoError(t, err)
	if form != "" {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for i := 0; i+1 < len(header); i += 2 {
		if header[i] == "Host" {
			req.Host = header[i+1]
			continue
		}
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return reply{resp.StatusCode, string(b), resp.Header.Get("Location")}
}

// Mounted under a prefix, every page, link, form, stylesheet and redirect
// of the view is under it, and nothing outside it is answered.
func TestTheViewServesUnderItsPrefix(t *testing.T) {
	srv, id := view(t, "/admin/sagas")
	page := get(t, srv.URL+"/admin/sagas/")
	require.Equal(t, http.StatusOK, page.status, page.body)
	assert.Contains(t, page.body, `href="/admin/sagas/sagas/`+id.String()+`"`)
	assert.Contains(t, page.body, `action="/admin/sagas/sagas"`)
	assert.Contains(t, page.body, `href="/admin/sagas/dead-letters"`)
	for _, m := range regexp.MustCompile(`(?:href|action|src)="(/[^"]*)"`).FindAllStringSubmatch(page.body, -1) {
		assert.True(t, strings.HasPrefix(m[1], "/admin/sagas/"), "a link outside the prefix: %s", m[0])
	}
	css := get(t, srv.URL+"/admin/sagas/static/style.css")
	assert.Equal(t, http.StatusOK, css.status)
	assert.Contains(t, css.body, "{", "the stylesheet")
	one := get(t, srv.URL+"/admin/sagas/sagas/"+id.String())
	assert.Equal(t, http.StatusOK, one.status)
	assert.Contains(t, one.body, `action="/admin/sagas/sagas/`+id.String()+`/cancel"`)

	bare := get(t, srv.URL+"/admin/sagas")
	assert.Equal(t, "/admin/sagas/", bare.location, "the prefix without its slash: to the view")
	assert.Equal(t, http.StatusNotFound, get(t, srv.URL+"/sagas").status)

	host := strings.TrimPrefix(srv.URL, "http://")
	cancel := do(t, http.MethodPost, srv.URL+"/admin/sagas/sagas/"+id.String()+"/cancel", url.Values{"reason": {"test"}}.Encode(), "Origin", "http://"+host)
	require.Equal(t, http.StatusSeeOther, cancel.status, cancel.body)
	assert.True(t, strings.HasPrefix(cancel.location, "/admin/sagas/sagas/"+id.String()+"?request="), cancel.location)
}

// Without Config.Hosts, a button press counts only from a page of the
// host it is sent to; with them, from those hosts, and other hosts are
// not answered.
func TestTheViewTakesButtonPressesFromItsOwnPagesOnly(t *testing.T) {
	srv, id := view(t, "")
	host := strings.TrimPrefix(srv.URL, "http://")
	cancel := srv.URL + "/sagas/" + id.String() + "/cancel"
	for name, origin := range map[string]string{"another site": "http://evil.test", "no origin": "", "another port": "http://127.0.0.1:1"} {
		var header []string
		if origin != "" {
			header = []string{"Origin", origin}
		}
		a := do(t, http.MethodPost, cancel, "reason=x", header...)
		assert.Equal(t, http.StatusForbidden, a.status, name)
	}
	a := do(t, http.MethodPost, cancel, "reason=x", "Origin", "http://"+host, "Sec-Fetch-Site", "cross-site")
	assert.Equal(t, http.StatusForbidden, a.status, "a browser that says the press came from another site")

	named, _ := view(t, "", "admin.test")
	assert.Equal(t, http.StatusForbidden, get(t, named.URL+"/sagas").status, "a host not among Hosts")
	assert.Equal(t, http.StatusOK, get(t, named.URL+"/sagas", "Host", "admin.test").status)
}

// New refuses a config it cannot serve.
func TestNewRefusesABadConfig(t *testing.T) {
	_, err := sagaui.New(sagaui.Config{})
	assert.ErrorIs(t, err, sagaui.ErrInvalidConfig)
	client, err := saga.NewClientFromDB(nil, saga.ClientConfig{})
	if err == nil {
		for _, prefix := range []string{"admin", "/admin/", "/a/../b", "/a b", "/a?b"} {
			_, err := sagaui.New(sagaui.Config{Client: client, Prefix: prefix})
			assert.ErrorIs(t, err, sagaui.ErrInvalidConfig, prefix)
		}
	}
}
