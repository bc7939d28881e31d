package main

import (
	"context"
	"encoding/base64"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
	"github.com/pgsaga/pgsaga/saga"
)

// Secrets the tests log in with.
const (
	testToken    = "tok-4f9a2c7e1b8d3a6f-secret"
	testPassword = "pw-8e1d4b7a2f6c9e3d-secret"
)

// loginFrom is the login the environment env configures.
func loginFrom(t *testing.T, env map[string]string) *uiAuth {
	t.Helper()
	auth, err := uiAuthFromEnv(func(k string) string { return env[k] })
	require.NoError(t, err)
	require.NotNil(t, auth)
	return auth
}

func basicAuth(user, password string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+password))
}

// With a login configured every address answers 401, with a challenge and
// nothing of the database, unless the request carries the credential, and
// a button pressed without it changes nothing: for a user and password
// (basic authentication), a bearer token, or both; off loopback and on it.
// The secret is never logged.
func TestUILogin(t *testing.T) {
	db := testdb.Fresh(t)
	subscribe(t, db.SQL, "late.topic", "late.group")
	const basicChallenge, bearerChallenge = `Basic realm="pgsaga ui", charset="UTF-8"`, `Bearer realm="pgsaga ui"`
	for _, tc := range []struct {
		name       string
		env        map[string]string
		allow      []string
		good, bad  []string
		challenges []string
	}{{
		name: "basic", env: map[string]string{envUIUser: "operator", envUIPassword: testPassword}, allow: []string{"ui.example"},
		good: []string{basicAuth("operator", testPassword), "basic " + base64.StdEncoding.EncodeToString([]byte("operator:"+testPassword))},
		bad: []string{"", basicAuth("operator", "wrong"), basicAuth("someone", testPassword), basicAuth("operator", testPassword+"x"),
			basicAuth("operator", testPassword[:len(testPassword)-1]), basicAuth("", testPassword), "Basic " + base64.StdEncoding.EncodeToString([]byte(testPassword)),
			"Basic !!!", "Bearer " + testPassword, testPassword, "Basic"},
		challenges: []string{basicChallenge},
	}, {
		name: "bearer", env: map[string]string{envUIToken: testToken}, allow: []string{"ui.example"},
		good: []string{"Bearer " + testToken, "bearer " + testToken},
		bad: []string{"", "Bearer wrong", "Bearer " + testToken + "x", "Bearer " + testToken[:len(testToken)-1], "Bearer",
			basicAuth("operator", testToken), basicAuth(testToken, ""), testToken, "Token " + testToken},
		challenges: []string{bearerChallenge},
	}, {
		name: "both", env: map[string]string{envUIUser: "operator", envUIPassword: testPassword, envUIToken: testToken}, allow: []string{"ui.example"},
		good:       []string{basicAuth("operator", testPassword), "Bearer " + testToken},
		bad:        []string{"", "Bearer " + testPassword, basicAuth("operator", testToken)},
		challenges: []string{basicChallenge, bearerChallenge},
	}, {
		name: "basic on loopback", env: map[string]string{envUIUser: "operator", envUIPassword: testPassword},
		good:       []string{basicAuth("operator", testPassword)},
		bad:        []string{"", basicAuth("operator", "wrong")},
		challenges: []string{basicChallenge},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			dl := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "late.topic", Group: "late.group", Reason: "nobody read it"})
			replay := "/dead-letters/" + strconv.FormatInt(dl, 10) + "/replay"
			// Every wrong credential is tried on every page: more failures
			// than the throttle lets through (TestUILoginThrottled).
			s := serveTestUI(t, db.URL, uiConfig{Auth: loginFrom(t, tc.env), Logins: loginThrottle{ClientBurst: 1000, GlobalBurst: 1000}}, uiServing{Allow: tc.allow})
			b := s.browser(t)
			for _, cred := range tc.bad {
				b.authorization = cred
				for _, path := range []string{"/sagas", "/dead-letters", "/dead-letters/" + strconv.FormatInt(dl, 10) + "/payload",
					"/static/style.css", "/healthz", "/no/such/page"} {
					a := b.get(path)
					assert.Equal(t, http.StatusUnauthorized, a.status, "%s with %q", path, cred)
					assert.Equal(t, tc.challenges, a.header.Values("WWW-Authenticate"), "%s with %q", path, cred)
					assert.NotContains(t, a.body, testWhere)
					assert.NotContains(t, a.body, "nobody read it")
				}
				a := b.press(replay, nil)
				assert.Equal(t, http.StatusUnauthorized, a.status, "a button with %q", cred)
			}
			assert.False(t, replayed(t, db.SQL, dl), "nothing was replayed")
			for _, cred := range tc.good {
				b.authorization = cred
				for _, path := range []string{"/sagas", "/dead-letters", "/static/style.css", "/healthz"} {
					a := b.get(path)
					assert.Equal(t, http.StatusOK, a.status, "%s with %q", path, cred)
					assert.Empty(t, a.header.Values("WWW-Authenticate"))
				}
				assert.Contains(t, b.get("/dead-letters").body, "nobody read it")
			}
			b.authorization = tc.good[0]
			a := b.press(replay, nil)
			assert.Equal(t, http.StatusSeeOther, a.status, a.body)
			assert.True(t, replayed(t, db.SQL, dl))
			for _, secret := range []string{testPassword[:8], testToken[:8], base64.StdEncoding.EncodeToString([]byte("operator:" + testPassword))[:8]} {
				assert.NotContains(t, s.log.String(), secret, "the log never holds a secret, nor a part of one")
			}
			assert.Contains(t, s.log.String(), "ui: login refused")
		})
	}
}

// The login comes from the environment or from a file that only its owner
// (and group) may read; a setting that cannot be used is refused, saying
// why and never the secret.
func TestUILoginSettings(t *testing.T) {
	dir := t.TempDir()
	file := func(name, content string, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
		require.NoError(t, os.Chmod(p, mode))
		return p
	}
	tokenFile := file("token", testToken+"\n", 0o600)
	passwordFile := file("password", testPassword+"\r\n", 0o440)
	readable := file("readable", testToken, 0o644)
	writable := file("writable", testToken, 0o602)
	empty := file("empty", "\n", 0o600)
	long := file("long", strings.Repeat("x", 5000), 0o600)

	auth, err := uiAuthFromEnv(func(string) string { return "" })
	require.NoError(t, err)
	assert.Nil(t, auth, "no login configured")

	for cred, env := range map[string]map[string]string{
		"Bearer " + testToken:                      {envUITokenFile: tokenFile},
		basicAuth("operator", testPassword):        {envUIUser: "operator", envUIPasswordFile: passwordFile},
		basicAuth("opérateur", "pässwörd-ünïcödé"): {envUIUser: "opérateur", envUIPassword: "pässwörd-ünïcödé"},
	} {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("Authorization", cred)
		assert.True(t, loginFrom(t, env).allows(r), "%v", env)
	}

	for name, tc := range map[string]struct {
		env  map[string]string
		want string
	}{
		"token twice":                {map[string]string{envUIToken: testToken, envUITokenFile: tokenFile}, "set PGSAGA_UI_TOKEN or PGSAGA_UI_TOKEN_FILE, not both"},
		"password twice":             {map[string]string{envUIUser: "operator", envUIPassword: testPassword, envUIPasswordFile: passwordFile}, "set PGSAGA_UI_PASSWORD or PGSAGA_UI_PASSWORD_FILE, not both"},
		"user without password":      {map[string]string{envUIUser: "operator"}, "PGSAGA_UI_USER needs PGSAGA_UI_PASSWORD or PGSAGA_UI_PASSWORD_FILE"},
		"password without user":      {map[string]string{envUIPassword: testPassword}, "PGSAGA_UI_PASSWORD needs PGSAGA_UI_USER"},
		"password file without user": {map[string]string{envUIPasswordFile: passwordFile}, "PGSAGA_UI_PASSWORD_FILE needs PGSAGA_UI_USER"},
		"short token":                {map[string]string{envUIToken: "0123456789"}, "PGSAGA_UI_TOKEN is too short: at least 16 characters"},
		"short token in a file":      {map[string]string{envUITokenFile: file("short", "0123456789\n", 0o600)}, "PGSAGA_UI_TOKEN_FILE is too short"},
		"short password":             {map[string]string{envUIUser: "operator", envUIPassword: "0123456789"}, "PGSAGA_UI_PASSWORD is too short"},
		"token with a space":         {map[string]string{envUIToken: "0123456789 abcdefgh"}, "PGSAGA_UI_TOKEN may hold only"},
		"password with a control":    {map[string]string{envUIUser: "operator", envUIPassword: testPassword + "\x1b"}, "PGSAGA_UI_PASSWORD holds a control character"},
		"password not UTF-8":         {map[string]string{envUIUser: "operator", envUIPassword: testPassword + "\xff"}, "PGSAGA_UI_PASSWORD is not UTF-8 text"},
		"user with a colon":          {map[string]string{envUIUser: "op:erator", envUIPassword: testPassword}, "PGSAGA_UI_USER must not hold a colon"},
		"readable by all":            {map[string]string{envUITokenFile: readable}, "PGSAGA_UI_TOKEN_FILE " + readable + " may be read or written by every user of this machine (mode 0644): chmod o-rwx"},
		"writable by all":            {map[string]string{envUITokenFile: writable}, "(mode 0602)"},
		"missing":                    {map[string]string{envUITokenFile: filepath.Join(dir, "missing")}, "PGSAGA_UI_TOKEN_FILE: "},
		"a directory":                {map[string]string{envUIUser: "operator", envUIPasswordFile: dir}, "is not a regular file"},
		"empty":                      {map[string]string{envUITokenFile: empty}, "PGSAGA_UI_TOKEN_FILE " + empty + " is empty"},
		"too long":                   {map[string]string{envUITokenFile: long}, "longer than 4096 bytes"},
	} {
		auth, err := uiAuthFromEnv(func(k string) string { return tc.env[k] })
		assert.Nil(t, auth, name)
		if assert.Error(t, err, name) {
			assert.Contains(t, err.Error(), tc.want, name)
			for _, secret := range []string{testToken, testPassword, "0123456789"} {
				assert.NotContains(t, err.Error(), secret, name)
			}
		}
	}
}

// Off loopback the command refuses to start (exit 2, one sentence, before
// it opens anything) without both a login and the host names it serves;
// with both it answers only under those names and with the login. On
// loopback it needs neither.
func TestUIExposedNeedsLoginAndHostNames(t *testing.T) {
	for _, k := range []string{envUIToken, envUITokenFile, envUIUser, envUIPassword, envUIPasswordFile} {
		t.Setenv(k, "")
	}
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=5") // nothing may open it
	usage := func(args ...string) string {
		t.Helper()
		code, _, errOut := pgsaga(t, append([]string{"ui"}, args...)...)
		assert.Equal(t, exitUsage, code, "%v: %s", args, errOut)
		assert.Equal(t, 2, strings.Count(errOut, "\n"), "one sentence, and where the usage is: %s", errOut)
		assert.NotContains(t, errOut, testToken)
		return errOut
	}
	for _, addr := range []string{"0.0.0.0:8080", ":8080", "[::]:8080", "192.0.2.7:8080", "[2001:db8::1]:8080", "ui.example.com:8080", "localhost.example.com:8080"} {
		out := usage("--addr", addr)
		assert.Contains(t, out, "--addr "+addr+" can be reached from other machines", addr)
		assert.Contains(t, out, "PGSAGA_UI_TOKEN", addr)
		assert.Contains(t, out, "--allow-host NAME", addr)
		out = usage("--addr", addr, "--allow-host", "ui.example.com")
		assert.Contains(t, out, "PGSAGA_UI_TOKEN", addr)
		assert.NotContains(t, out, "--allow-host NAME", addr)
	}
	t.Setenv(envUIToken, testToken)
	out := usage("--addr", "0.0.0.0:8080")
	assert.Contains(t, out, "--allow-host NAME")
	assert.NotContains(t, out, "PGSAGA_UI_TOKEN")
	for _, bad := range []string{"bad host!", "ui.example.com:99999", "ui.example.com:x", "", "http://ui.example.com", "999.1.1.1", "ui.example.com/x"} {
		assert.Contains(t, usage("--addr", "0.0.0.0:8080", "--allow-host", bad), "--allow-host", bad)
	}
	t.Setenv(envUIUser, "operator")
	assert.Contains(t, usage("--addr", "127.0.0.1:0"), "PGSAGA_UI_USER needs PGSAGA_UI_PASSWORD", "a login that cannot be used is refused on loopback too")
	t.Setenv(envUIUser, "")

	db := testdb.Fresh(t)
	t.Setenv("DATABASE_URL", db.URL)
	serve := func(args ...string) (port string, stop func()) {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		var stderr testout.Buffer
		done := make(chan int, 1)
		go func() { done <- run(ctx, append([]string{"ui"}, args...), io.Discard, &stderr) }()
		u, err := url.Parse(servingAt(t, &stderr))
		require.NoError(t, err)
		return u.Port(), func() {
			cancel()
			assert.Equal(t, exitOK, <-done, stderr.String())
			assert.NotContains(t, stderr.String(), testToken)
		}
	}

	// Off loopback, with both.
	port, stop := serve("--addr", "0.0.0.0:0", "--allow-host", "ui.example.com", "--allow-host", "[2001:DB8::7]:8443")
	ask := func(host, authorization string) int {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, "http://127.0.0.1:"+port+"/sagas", nil)
		require.NoError(t, err)
		req.Host = host
		if authorization != "" {
			req.Header.Set("Authorization", authorization)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	assert.Equal(t, http.StatusOK, ask("ui.example.com:"+port, "Bearer "+testToken))
	assert.Equal(t, http.StatusOK, ask("UI.example.com", "Bearer "+testToken), "behind a proxy on the default port")
	assert.Equal(t, http.StatusOK, ask("[2001:db8::7]:8443", "Bearer "+testToken))
	assert.Equal(t, http.StatusUnauthorized, ask("ui.example.com:"+port, ""))
	assert.Equal(t, http.StatusForbidden, ask("127.0.0.1:"+port, "Bearer "+testToken), "off loopback, only the names given")
	assert.Equal(t, http.StatusForbidden, ask("evil.example:"+port, "Bearer "+testToken))
	assert.Equal(t, http.StatusForbidden, ask("[2001:db8::7]:"+port, "Bearer "+testToken), "a name given with a port is that port only")
	stop()

	// On loopback, with neither.
	t.Setenv(envUIToken, "")
	port, stop = serve("--addr", "localhost:0")
	assert.Equal(t, http.StatusOK, ask("localhost:"+port, ""))
	assert.Equal(t, http.StatusForbidden, ask("ui.example.com:"+port, ""))
	stop()
}

// Served as exposed (--addr off loopback, --allow-host ui.example, a
// login), the pages answer only under the names given: asked for under
// another (a site whose name points at this machine: DNS rebinding) they
// are refused and say nothing. A button press is done only from a page of
// those names, whatever Host the request names; from any other page,
// nothing changes.
func TestUIExposedAnswersOnlyItsNames(t *testing.T) {
	db := testdb.Fresh(t)
	running := insertSaga(t, db.SQL, sqlSaga{Type: "job", Step: "work", Status: saga.StatusRunning})
	dl := insertDeadLetter(t, db.SQL, sqlDeadLetter{Topic: "late.topic", Group: "late.group", Reason: "nobody read it"})
	subscribe(t, db.SQL, "late.topic", "late.group")
	s := serveTestUI(t, db.URL, uiConfig{Auth: loginFrom(t, map[string]string{envUIToken: testToken}), RequestWait: 50 * time.Millisecond},
		uiServing{Allow: []string{"ui.example", "ops.example:8443"}})
	b := s.browser(t)
	b.authorization = "Bearer " + testToken
	port := s.port
	_, err := newUI(uiConfig{DB: db.SQL})
	assert.ErrorContains(t, err, "Hosts are required", "no view answers to any name")

	// Reading.
	home := b.get("/sagas")
	require.Equal(t, http.StatusOK, home.status, home.body)
	assert.Contains(t, home.body, running.String())
	for host, status := range map[string]int{
		"ui.example": http.StatusOK, "UI.EXAMPLE:" + port: http.StatusOK, "ops.example:8443": http.StatusOK,
		"evil.example:" + port: http.StatusForbidden, "evil.example": http.StatusForbidden, "127.0.0.1:" + port: http.StatusForbidden,
		"localhost:" + port: http.StatusForbidden, "ui.example.evil.example:" + port: http.StatusForbidden,
		"ops.example:" + port: http.StatusForbidden, "ops.example": http.StatusForbidden, "ui.example:1": http.StatusForbidden,
	} {
		a := b.do(http.MethodGet, "/sagas", nil, map[string]string{"Host": host})
		assert.Equal(t, status, a.status, host)
		if status == http.StatusForbidden {
			assert.NotContains(t, a.body, running.String(), host)
			assert.NotContains(t, a.body, testWhere, host)
			assert.Contains(t, a.body, "does not answer to the host name", host)
		}
	}

	// Pressing a button from elsewhere: refused, nothing changed.
	cancel := "/sagas/" + running.String() + "/cancel"
	retry := "/sagas/" + running.String() + "/retry"
	replay := "/dead-letters/" + strconv.FormatInt(dl, 10) + "/replay"
	for name, header := range map[string]map[string]string{
		"rebinding: the Host and Origin of another name":  {"Host": "evil.example:" + port, "Origin": "http://evil.example:" + port},
		"rebinding, same-origin by the browser's account": {"Host": "evil.example:" + port, "Origin": "http://evil.example:" + port, "Sec-Fetch-Site": "same-origin"},
		"another site":                           {"Origin": "http://evil.example"},
		"another site, the Host forged to match": {"Host": "evil.example", "Origin": "http://evil.example"},
		"another site claiming same-origin":      {"Origin": "http://evil.example", "Sec-Fetch-Site": "same-origin"},
		"a name given, on another port":          {"Origin": "http://ui.example:1"},
		"a name given with its port, on another": {"Origin": "http://ops.example:" + port},
		"the address it listens on":              {"Origin": "http://127.0.0.1:" + port},
		"an allowed Origin, cross-site fetch":    {"Origin": "http://ui.example:" + port, "Sec-Fetch-Site": "cross-site"},
		"an allowed Origin, same-site fetch":     {"Origin": "http://ui.example:" + port, "Sec-Fetch-Site": "same-site"},
		"no Origin":                              {},
		"no Origin, same-origin":                 {"Sec-Fetch-Site": "same-origin"},
		"a null Origin":                          {"Origin": "null"},
		"an Origin with a path":                  {"Origin": "http://ui.example:" + port + "/x"},
		"an Origin of another scheme":            {"Origin": "ftp://ui.example:" + port},
		"an Origin with a user":                  {"Origin": "http://evil@ui.example:" + port},
		"an Origin with a query":                 {"Origin": "http://ui.example:" + port + "?x"},
		"an Origin with a fragment":              {"Origin": "http://ui.example:" + port + "#x"},
	} {
		for _, path := range []string{cancel, retry, replay} {
			a := b.do(http.MethodPost, path, url.Values{"reason": {"attack"}}, header)
			assert.Equal(t, http.StatusForbidden, a.status, "%s: %s", name, path)
		}
	}
	// With an allowed Origin but no login.
	a := b.do(http.MethodPost, cancel, url.Values{}, map[string]string{"Origin": b.base, "Authorization": ""})
	assert.Equal(t, http.StatusUnauthorized, a.status)
	assert.Zero(t, requestsOf(t, db.SQL, running), "nothing was asked")
	assert.False(t, replayed(t, db.SQL, dl), "nothing was replayed")

	// From a page of its own, with the login: done.
	a = b.press(replay, nil)
	assert.Equal(t, http.StatusSeeOther, a.status, a.body)
	assert.True(t, replayed(t, db.SQL, dl))
	a = b.do(http.MethodPost, cancel, url.Values{}, map[string]string{"Origin": b.base, "Sec-Fetch-Site": "same-origin"})
	assert.Equal(t, http.StatusSeeOther, a.status, a.body)
	assert.Equal(t, 1, requestsOf(t, db.SQL, running))
	a = b.do(http.MethodPost, retry, url.Values{}, map[string]string{"Origin": "https://ui.example", "Host": "ui.example"})
	assert.Equal(t, http.StatusSeeOther, a.status, "through a TLS proxy: %s", a.body)
	assert.Equal(t, 2, requestsOf(t, db.SQL, running))
	a = b.do(http.MethodPost, retry, url.Values{}, map[string]string{"Origin": "https://ops.example:8443", "Host": "ui.example:" + port})
	assert.Equal(t, http.StatusSeeOther, a.status, "from another name given (the same request again): %s", a.body)
}

// The host names a server answers to: on loopback, the machine's own
// names for the port it listens on, and those given; off loopback, only
// those given: a name without a port on the port it listens on or on the
// default one, a name with a port on that one.
func TestUIAllowedHosts(t *testing.T) {
	bound := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 8080}
	assert.Equal(t, []string{"localhost:8080", "127.0.0.1:8080", "[::1]:8080"}, allowedHosts(true, "127.0.0.1:8080", bound, nil))
	assert.Equal(t, []string{"localhost:8080", "127.0.0.1:8080", "[::1]:8080", "ui.example:8080", "ui.example"},
		allowedHosts(true, "localhost:8080", bound, []string{"ui.example"}))
	assert.Equal(t, []string{"ui.example:8080", "ui.example", "ops.example:8443", "[2001:db8::7]:8080", "[2001:db8::7]"},
		allowedHosts(false, "0.0.0.0:8080", bound, []string{"ui.example", "ops.example:8443", "[2001:db8::7]"}))
	v6 := &net.TCPAddr{IP: net.IPv6loopback, Port: 80}
	assert.Equal(t, []string{"localhost:80", "localhost", "127.0.0.1:80", "127.0.0.1", "[::1]:80", "[::1]"}, allowedHosts(true, "[::1]:80", v6, nil))

	for addr, loopback := range map[string]bool{
		"127.0.0.1:8080": true, "127.3.4.5:8080": true, "[::1]:8080": true, "localhost:8080": true, "LOCALHOST:0": true,
		"0.0.0.0:8080": false, ":8080": false, "[::]:8080": false, "192.168.1.10:8080": false, "ui.example:8080": false,
		"localhost.example:8080": false, "[::ffff:10.0.0.1]:8080": false,
	} {
		assert.Equal(t, loopback, loopbackAddr(addr), addr)
	}
}
