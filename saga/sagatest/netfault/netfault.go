// Package netfault puts network faults between your service and the
// servers it talks to (PostgreSQL, a message broker), in a test: a Link is
// a TCP proxy in the test's process (Toxiproxy, github.com/Shopify/toxiproxy/v2,
// as a library) that your service dials instead of the server, and that
// delays, throttles, resets or cuts what crosses it while the test runs.
//
//	link, through := netfault.Through(t, db.URL) // the database's URL, through the link
//	link.Latency(20*time.Millisecond, 10*time.Millisecond)
//	link.Partition(30 * time.Second) // nothing crosses for 30 s, then it heals
//
// It is a package of its own so that sagatest alone pulls no proxy into a
// test build.
package netfault

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Link is a TCP path to one server through a proxy in the test's process.
// Its methods are safe for concurrent use; each fault stays until it is
// removed (Heal removes them all).
type Link struct {
	t     testing.TB
	proxy *toxiproxy.Proxy

	mu     sync.Mutex
	faults []string // names of the toxics in place
	timer  *time.Timer
}

// New starts a link to upstream (host:port) on a port of its own on
// 127.0.0.1, closed when the test ends.
func New(t testing.TB, upstream string) *Link {
	t.Helper()
	server := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(prometheus.NewRegistry()), zerolog.Nop())
	p := toxiproxy.NewProxy(server, "netfault-"+upstream, "127.0.0.1:0", upstream)
	if err := p.Start(); err != nil {
		t.Fatalf("netfault: starting a link to %s: %v", upstream, err)
	}
	l := &Link{t: t, proxy: p}
	t.Cleanup(func() {
		l.mu.Lock()
		if l.timer != nil {
			l.timer.Stop()
		}
		l.mu.Unlock()
		p.Stop()
	})
	return l
}

// Through starts a link to the server rawURL names (a postgres:// URL of
// one host, a nats:// URL) and returns it with rawURL through it (URL).
func Through(t testing.TB, rawURL string) (*Link, string) {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" {
		t.Fatalf("netfault: a link needs a URL with a host and port, got %q", rawURL)
	}
	l := New(t, u.Host)
	through, err := l.URL(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	return l, through
}

// Addr is the host:port to dial instead of the server's.
func (l *Link) Addr() string { return l.proxy.Listen }

// URL is rawURL (a postgres:// or nats:// URL, say) with its host and port
// those of the link. A URL of several hosts, or of none, is refused.
func (l *Link) URL(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "", fmt.Errorf("netfault: %w", err)
	}
	if u.Host == "" || bytes.ContainsRune([]byte(u.Host), ',') {
		return "", fmt.Errorf("netfault: the URL must name one host and port")
	}
	u.Host = l.Addr()
	return u.String(), nil
}

// Latency delays what crosses the link, both ways, by latency give or
// take jitter (each way: a round trip costs twice).
func (l *Link) Latency(latency, jitter time.Duration) error {
	if latency < 0 || jitter < 0 {
		return fmt.Errorf("%w: latency %s, jitter %s", ErrInvalidFault, latency, jitter)
	}
	return l.both("latency", 1, map[string]any{"latency": latency.Milliseconds(), "jitter": jitter.Milliseconds()})
}

// Bandwidth limits the link to kbps kilobytes a second, each way.
func (l *Link) Bandwidth(kbps int64) error {
	if kbps <= 0 {
		return fmt.Errorf("%w: bandwidth %d KB/s", ErrInvalidFault, kbps)
	}
	return l.both("bandwidth", 1, map[string]any{"rate": kbps})
}

// Reset resets (TCP RST) each connection with probability toxicity as
// soon as it next carries data, mid-stream: a statement or a batch cut off
// between its request and its answer, as a crashed peer or a middlebox
// would. Connections opened later are reset too, with the same chance,
// until Heal, or Reset(0).
func (l *Link) Reset(toxicity float64) error {
	if toxicity < 0 || toxicity > 1 {
		return fmt.Errorf("%w: toxicity %v", ErrInvalidFault, toxicity)
	}
	return l.add("reset_peer", "upstream", toxicity, map[string]any{"timeout": 0})
}

// Partition cuts the link for d: nothing crosses it either way, and
// connections neither close nor answer (as when a network drops packets),
// until it heals on its own after d (Heal heals it sooner). What was in
// flight is lost: a connection used across a partition is broken.
func (l *Link) Partition(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%w: partition of %s", ErrInvalidFault, d)
	}
	if err := l.both("timeout", 1, map[string]any{"timeout": 0}); err != nil {
		return err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.timer = time.AfterFunc(d, func() { l.remove("timeout") })
	return nil
}

// Heal removes every fault: the link carries everything again, at once.
func (l *Link) Heal() {
	l.mu.Lock()
	names := append([]string(nil), l.faults...)
	if l.timer != nil {
		l.timer.Stop()
	}
	l.mu.Unlock()
	for _, n := range names {
		l.removeNamed(n)
	}
}

// both adds a toxic of kind on each direction.
func (l *Link) both(kind string, toxicity float64, attrs map[string]any) error {
	for _, stream := range []string{"upstream", "downstream"} {
		if err := l.add(kind, stream, toxicity, attrs); err != nil {
			return err
		}
	}
	return nil
}

// add puts a toxic in place, replacing one of the same kind and direction.
func (l *Link) add(kind, stream string, toxicity float64, attrs map[string]any) error {
	name := kind + "_" + stream
	l.removeNamed(name)
	body, err := json.Marshal(map[string]any{"name": name, "type": kind, "stream": stream, "toxicity": toxicity, "attributes": attrs})
	if err != nil {
		return err
	}
	if _, err := l.proxy.Toxics.AddToxicJson(bytes.NewReader(body)); err != nil {
		return fmt.Errorf("netfault: %s: %w", name, err)
	}
	l.mu.Lock()
	l.faults = append(l.faults, name)
	l.mu.Unlock()
	return nil
}

// remove removes the toxics of kind, both directions.
func (l *Link) remove(kind string) {
	for _, stream := range []string{"upstream", "downstream"} {
		l.removeNamed(kind + "_" + stream)
	}
}

func (l *Link) removeNamed(name string) {
	l.mu.Lock()
	kept := l.faults[:0]
	found := false
	for _, n := range l.faults {
		if n == name {
			found = true
			continue
		}
		kept = append(kept, n)
	}
	l.faults = kept
	l.mu.Unlock()
	if found {
		_ = l.proxy.Toxics.RemoveToxic(context.Background(), name)
	}
}
