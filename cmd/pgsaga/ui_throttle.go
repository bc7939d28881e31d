package main

// The web view's login throttle: failed logins from one address, and from
// all of them, are limited by token buckets; a client over its limit is
// answered 429 before its credential is looked at, and refusals are
// logged a line at a time per minute, not one line each.

import (
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Defaults of loginThrottle.
const (
	// A client (an IPv4 address, or an IPv6 /64) may fail 10 logins at
	// once, then one every 6 seconds.
	clientFailuresBurst = 10
	clientFailuresEvery = 6 * time.Second
	// All clients together may fail 100 at once, then one every 600ms;
	// past that, only a client that logged in lately is let try.
	globalFailuresBurst = 100
	globalFailuresEvery = 600 * time.Millisecond
	// loggedInFor is how long a client that logged in is let try past
	// the global limit.
	loggedInFor = time.Hour
	// maxClients bounds the clients remembered.
	maxClients = 10000
	// refusalLogEvery is how often refused logins are logged at most.
	refusalLogEvery = time.Minute
)

// loginThrottle limits failed logins. Zero values take the defaults.
type loginThrottle struct {
	// ClientBurst failures of one client at once, then one each
	// ClientEvery.
	ClientBurst int
	ClientEvery time.Duration
	// GlobalBurst failures of all clients at once, then one each
	// GlobalEvery.
	GlobalBurst int
	GlobalEvery time.Duration
}

func (c loginThrottle) withDefaults() loginThrottle {
	if c.ClientBurst <= 0 {
		c.ClientBurst = clientFailuresBurst
	}
	if c.ClientEvery <= 0 {
		c.ClientEvery = clientFailuresEvery
	}
	if c.GlobalBurst <= 0 {
		c.GlobalBurst = globalFailuresBurst
	}
	if c.GlobalEvery <= 0 {
		c.GlobalEvery = globalFailuresEvery
	}
	return c
}

// bucket is a token bucket: it holds up to burst tokens, and gains one
// each every.
type bucket struct {
	tokens float64
	at     time.Time
}

func newBucket(burst int, now time.Time) bucket { return bucket{tokens: float64(burst), at: now} }

// fill adds the tokens gained since the last fill.
func (b *bucket) fill(now time.Time, burst int, every time.Duration) {
	if now.After(b.at) {
		b.tokens = math.Min(float64(burst), b.tokens+float64(now.Sub(b.at))/float64(every))
		b.at = now
	}
}

// wait is how long until the bucket holds a token (0 if it does).
func (b *bucket) wait(every time.Duration) time.Duration {
	if b.tokens >= 1 {
		return 0
	}
	return time.Duration((1 - b.tokens) * float64(every))
}

func (b *bucket) take() { b.tokens = math.Max(b.tokens-1, -1) }

type loginClient struct {
	failures bucket
	loggedIn time.Time // when it last logged in
}

// loginGuard keeps the throttle's state and the refusals not yet logged.
type loginGuard struct {
	cfg loginThrottle
	now func() time.Time
	log *slog.Logger

	mu      sync.Mutex
	clients map[string]*loginClient
	global  bucket
	swept   time.Time

	// The refusal log: when a line was last written, and what was
	// refused since.
	logged    time.Time
	refused   int
	throttled int
	from      map[string]bool
	flush     *time.Timer
}

func newLoginGuard(cfg loginThrottle, now func() time.Time, log *slog.Logger) *loginGuard {
	cfg = cfg.withDefaults()
	return &loginGuard{cfg: cfg, now: now, log: log, clients: map[string]*loginClient{}, global: newBucket(cfg.GlobalBurst, now()), from: map[string]bool{}}
}

// clientKey is who sent r, for the throttle: its IP address, an IPv6
// address's /64 (one machine commonly has a whole /64). Behind a proxy,
// every client is the proxy.
func clientKey(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return host
	}
	if v4 := ip.To4(); v4 != nil {
		return v4.String()
	}
	return ip.Mask(net.CIDRMask(64, 128)).String() + "/64"
}

// admit reports how long the client key must wait before it may try to
// log in: 0 if it may now.
func (g *loginGuard) admit(key string) time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	c := g.clients[key]
	if c != nil {
		c.failures.fill(now, g.cfg.ClientBurst, g.cfg.ClientEvery)
		if w := c.failures.wait(g.cfg.ClientEvery); w > 0 {
			return w
		}
		if now.Sub(c.loggedIn) < loggedInFor {
			return 0
		}
	}
	g.global.fill(now, g.cfg.GlobalBurst, g.cfg.GlobalEvery)
	return g.global.wait(g.cfg.GlobalEvery)
}

// failed counts a failed login of the client key.
func (g *loginGuard) failed(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	g.global.fill(now, g.cfg.GlobalBurst, g.cfg.GlobalEvery)
	g.global.take()
	if c := g.client(key, now); c != nil {
		c.failures.fill(now, g.cfg.ClientBurst, g.cfg.ClientEvery)
		c.failures.take()
	}
}

// loggedIn notes that the client key logged in.
func (g *loginGuard) loggedIn(key string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	if c := g.client(key, now); c != nil {
		c.loggedIn = now
	}
}

// client is the state of the client key, new if need be: nil if
// maxClients are remembered and none can be forgotten (the global limit
// still holds).
func (g *loginGuard) client(key string, now time.Time) *loginClient {
	if c := g.clients[key]; c != nil {
		return c
	}
	if len(g.clients) >= maxClients && now.Sub(g.swept) >= time.Second {
		g.swept = now
		for k, c := range g.clients {
			c.failures.fill(now, g.cfg.ClientBurst, g.cfg.ClientEvery)
			if c.failures.tokens >= float64(g.cfg.ClientBurst) && now.Sub(c.loggedIn) >= loggedInFor {
				delete(g.clients, k)
			}
		}
	}
	if len(g.clients) >= maxClients {
		return nil
	}
	c := &loginClient{failures: newBucket(g.cfg.ClientBurst, now)}
	g.clients[key] = c
	return c
}

// refusal logs a refused login (throttled: answered 429), with attrs: the
// first of a minute as it is, the others in a summary a minute after the
// line before, at the next refusal or by a timer, whichever is first.
func (g *loginGuard) refusal(key string, throttled bool, attrs ...any) {
	g.mu.Lock()
	defer g.mu.Unlock()
	now := g.now()
	g.refused++
	if throttled {
		g.throttled++
	}
	if len(g.from) < maxClients {
		g.from[key] = true
	}
	if g.logged.IsZero() || now.Sub(g.logged) >= refusalLogEvery {
		if g.refused == 1 {
			msg := "ui: login refused"
			if throttled {
				msg = "ui: login throttled"
			}
			g.log.Info(msg, attrs...)
			g.reset(now)
			return
		}
		g.summary(now)
		return
	}
	if g.flush == nil {
		g.flush = time.AfterFunc(refusalLogEvery-now.Sub(g.logged), func() {
			g.mu.Lock()
			defer g.mu.Unlock()
			g.flush = nil
			if g.refused > 0 {
				g.summary(g.now())
			}
		})
	}
}

// summary logs the refusals since the last line. g.mu is held.
func (g *loginGuard) summary(now time.Time) {
	g.log.Warn("ui: logins refused", "refused", g.refused, "throttled", g.throttled, "clients", len(g.from), // at most maxClients
		"since", g.logged.UTC().Format(time.RFC3339))
	g.reset(now)
}

func (g *loginGuard) reset(now time.Time) {
	g.logged, g.refused, g.throttled = now, 0, 0
	clear(g.from)
}

// stop stops the refusal log's timer, and logs the refusals not logged
// yet.
func (g *loginGuard) stop() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.flush != nil {
		g.flush.Stop()
		g.flush = nil
	}
	if g.refused > 0 {
		g.summary(g.now())
	}
}

// tooManyLogins answers 429: the client must wait before it tries again.
func tooManyLogins(w http.ResponseWriter, wait time.Duration) {
	secs := max(1, int(math.Ceil(wait.Seconds())))
	w.Header().Set("Retry-After", strconv.Itoa(secs))
	plainError(w, http.StatusTooManyRequests, fmt.Sprintf("pgsaga ui: too many failed logins; try again in %d s.", secs))
}
