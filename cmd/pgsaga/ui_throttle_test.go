package main

import (
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
)

// fakeClock is a clock a test moves by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.now }

func (c *fakeClock) Advance(d time.Duration) { c.mu.Lock(); c.now = c.now.Add(d); c.mu.Unlock() }

// Wrong tokens sent quickly from one address are answered 429, with a
// Retry-After, once a handful have failed: then even the right token is
// (a guess must not learn it was right), until the wait is over; the
// refusals are logged as a first line and a summary at most once a
// minute, not one line each.
func TestUILoginThrottled(t *testing.T) {
	db := testdb.Fresh(t)
	clock := &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	s := serveTestUI(t, db.URL, uiConfig{Auth: loginFrom(t, map[string]string{envUIToken: testToken}), Now: clock.Now}, uiServing{Allow: []string{"ui.example"}})
	b := s.browser(t)

	const attempts = 100
	statuses := map[int]int{}
	var firstThrottled int
	var retryAfter string
	for i := range attempts {
		b.authorization = "Bearer wrong-" + strconv.Itoa(i) + "-4f9a2c7e1b8d3a6f"
		a := b.get("/sagas")
		statuses[a.status]++
		if a.status == http.StatusTooManyRequests && retryAfter == "" {
			firstThrottled, retryAfter = i, a.header.Get("Retry-After")
			assert.NotContains(t, a.body, testWhere)
		}
	}
	require.NotZero(t, statuses[http.StatusTooManyRequests], "no wrong token was throttled: %v", statuses)
	assert.LessOrEqual(t, firstThrottled, 20, "throttled after a handful of failures")
	assert.Equal(t, attempts, statuses[http.StatusUnauthorized]+statuses[http.StatusTooManyRequests], "%v", statuses)
	wait, err := strconv.Atoi(retryAfter)
	require.NoError(t, err, "Retry-After: %q", retryAfter)
	assert.Positive(t, wait)

	b.authorization = "Bearer " + testToken
	assert.Equal(t, http.StatusTooManyRequests, b.get("/sagas").status, "throttled, even the right token waits")

	logged := func() int {
		n := 0
		for _, line := range strings.Split(s.log.String(), "\n") {
			if strings.Contains(line, "ui: login") {
				n++
			}
		}
		return n
	}
	assert.LessOrEqual(t, logged(), 2, "the refusals are not logged one line each:\n%s", s.log.String())

	// A minute later, the next refusal logs a summary of those before.
	clock.Advance(time.Duration(wait)*time.Second + time.Minute)
	b.authorization = "Bearer wrong-again-4f9a2c7e1b8d3a6f"
	assert.Equal(t, http.StatusUnauthorized, b.get("/sagas").status, "after the wait, a wrong token is refused, not throttled")
	assert.LessOrEqual(t, logged(), 3, s.log.String())
	assert.Contains(t, s.log.String(), "ui: logins refused", "a summary")

	clock.Advance(10 * time.Minute)
	b.authorization = "Bearer " + testToken
	assert.Equal(t, http.StatusOK, b.get("/sagas").status, "after the wait, the right token works")
	assert.NotContains(t, s.log.String(), testToken[:8])
}

// A weak secret is refused at start, saying why and how to make a good
// one, never the secret: too short (as before), too few different
// characters, one kind of character only (unless long), a short string
// repeated, or a run like 0123… or abcd….
func TestUIWeakSecretsRefused(t *testing.T) {
	for _, weak := range []string{
		"aaaaaaaaaaaaaaaa",                 // one character
		"abababababababababababababababab", // two
		"passwordpassword",                 // a word twice
		"Pa55word!Pa55word!Pa55word!",      // repeated
		"0123456789abcdef",                 // a run
		"abcdefghijklmnopqrstuvwxyz",       // a run, one kind
		"9876543210fedcba",                 // a run down
		"9384756102938475",                 // digits only, short
		"qwertzuiopasdfgh",                 // lower-case letters only, short
	} {
		for _, env := range []map[string]string{{envUIToken: weak}, {envUIUser: "operator", envUIPassword: weak}} {
			auth, err := uiAuthFromEnv(func(k string) string { return env[k] })
			assert.True(t, auth == nil, "%s accepted", weak)
			if assert.Error(t, err, "%s accepted", weak) {
				assert.Contains(t, err.Error(), "openssl rand -hex 32", weak)
				assert.NotContains(t, err.Error(), weak)
			}
		}
	}
	// The command: exit 2 before it opens anything, one sentence.
	for _, k := range []string{envUIToken, envUITokenFile, envUIUser, envUIPassword, envUIPasswordFile} {
		t.Setenv(k, "")
	}
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere?connect_timeout=5")
	t.Setenv(envUIToken, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
	code, _, errOut := pgsaga(t, "ui", "--addr", "127.0.0.1:0")
	assert.Equal(t, exitUsage, code, errOut)
	assert.Contains(t, errOut, "PGSAGA_UI_TOKEN is too weak")
	assert.NotContains(t, errOut, "aaaaaaaa")

	for _, strong := range []string{
		testToken, testPassword,
		"3f9c1a7e5b2d8046",                 // openssl rand -hex 8
		"b1e0a4c95f37d28e6a1c0b94f7e3d582", // openssl rand -hex 16
		"kX9vQ2mL7pR4tZ8w",                 // mixed
		"correct horse battery staple now", // a passphrase
		"correcthorsebatterystaple",        // long, one kind
		"pässwörd-ünïcödé",                 // a password only: a token is ASCII
	} {
		if token := strings.ReplaceAll(strong, " ", "-"); token == strings.ToValidUTF8(token, "") && strings.IndexFunc(token, func(r rune) bool { return r > 0x7e }) < 0 {
			_, err := uiAuthFromEnv(func(k string) string { return map[string]string{envUIToken: token}[k] })
			assert.NoError(t, err, strong)
		}
		_, err := uiAuthFromEnv(func(k string) string {
			return map[string]string{envUIUser: "operator", envUIPassword: strong}[k]
		})
		assert.NoError(t, err, strong)
	}
}

// Failures from many addresses together are limited too, but a client
// that logged in lately may still try; an IPv6 client is its /64; the
// clients remembered are bounded.
func TestLoginGuardGlobalLimit(t *testing.T) {
	clock := &fakeClock{now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	var log strings.Builder
	g := newLoginGuard(loginThrottle{ClientBurst: 3, GlobalBurst: 20}, clock.Now, slog.New(slog.NewTextHandler(&log, nil)))
	defer g.stop()
	g.loggedIn("192.0.2.1")
	for i := range 20 {
		key := "198.51.100." + strconv.Itoa(i)
		require.Zero(t, g.admit(key), key)
		g.failed(key)
	}
	assert.Positive(t, g.admit("203.0.113.9"), "past the global limit, a new client waits")
	assert.Zero(t, g.admit("192.0.2.1"), "a client that logged in lately may still try")
	clock.Advance(globalFailuresEvery)
	assert.Zero(t, g.admit("203.0.113.9"), "the global bucket refills")

	r := func(remote string) *http.Request { return &http.Request{RemoteAddr: remote} }
	assert.Equal(t, "2001:db8:1:2::/64", clientKey(r("[2001:db8:1:2:aaaa::1]:5555")))
	assert.Equal(t, clientKey(r("[2001:db8:1:2:bbbb::7]:1")), clientKey(r("[2001:db8:1:2:aaaa::1]:5555")), "one /64, one client")
	assert.Equal(t, "192.0.2.1", clientKey(r("192.0.2.1:4444")))
	assert.Equal(t, "192.0.2.1", clientKey(r("[::ffff:192.0.2.1]:4444")))

	g = newLoginGuard(loginThrottle{GlobalBurst: 1 << 30}, clock.Now, slog.New(slog.DiscardHandler))
	for i := range maxClients + 100 {
		g.failed("10." + strconv.Itoa(i>>16) + "." + strconv.Itoa(i>>8&255) + "." + strconv.Itoa(i&255))
	}
	assert.Equal(t, maxClients, len(g.clients), "the clients remembered are bounded")
	clock.Advance(time.Duration(clientFailuresBurst) * clientFailuresEvery)
	g.failed("192.0.2.200")
	assert.Contains(t, g.clients, "192.0.2.200", "once the others have waited enough, they are forgotten")
	assert.Less(t, len(g.clients), 100)
}
