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
	"math"
	"net/url"
	"sync"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Link is a TCP path to one server through a proxy in the test's process.
// Its methods are safe for concurrent use (they take turns); each fault
// stays until it is removed (Heal removes them all).
type Link struct {
	t     testing.TB
	proxy *toxiproxy.Proxy

	mu     sync.Mutex // held by every change of the faults
	faults []string   // names of the toxics in place
	timer  *time.Timer
	cut    int // the latest partition's number: an older one's timer heals nothing
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
		l.cut++ // a timer already firing heals nothing
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
	if err != nil || u.Host == "" || u.Port() == "" {
		t.Fatalf("netfault: a link needs a URL with a host and its port, got %q", rawURL)
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
	if u.Host == "" || u.Port() == "" || bytes.ContainsRune([]byte(u.Host), ',') {
		return "", fmt.Errorf("netfault: the URL must name one host and its port")
	}
	u.Host = l.Addr()
	return u.String(), nil
}

// Latency delays what crosses the link, both ways, by latency give or
// take jitter (each way: a round trip costs twice). Toxiproxy counts in
// milliseconds: latency and jitter must be whole milliseconds, jitter at
// most latency.
func (l *Link) Latency(latency, jitter time.Duration) error {
	if latency < 0 || jitter < 0 || jitter > latency || latency%time.Millisecond != 0 || jitter%time.Millisecond != 0 {
		return fmt.Errorf("%w: latency %s, jitter %s (whole milliseconds, jitter at most latency)", ErrInvalidFault, latency, jitter)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.both("latency", 1, map[string]any{"latency": latency.Milliseconds(), "jitter": jitter.Milliseconds()})
}

// Bandwidth limits the link to kbps kilobytes a second, each way.
func (l *Link) Bandwidth(kbps int64) error {
	if kbps <= 0 {
		return fmt.Errorf("%w: bandwidth %d KB/s", ErrInvalidFault, kbps)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.both("bandwidth", 1, map[string]any{"rate": kbps})
}

// Reset resets (TCP RST) each connection with probability toxicity as
// soon as it next carries data, mid-stream: a statement or a batch cut off
// between its request and its answer, as a crashed peer or a middlebox
// would. Connections opened later are reset too, with the same chance,
// until Heal, or Reset(0), which stops it.
func (l *Link) Reset(toxicity float64) error {
	if toxicity < 0 || toxicity > 1 || math.IsNaN(toxicity) {
		return fmt.Errorf("%w: toxicity %v", ErrInvalidFault, toxicity)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if toxicity == 0 {
		l.removeNamed("reset_peer_upstream")
		return nil
	}
	return l.add("reset_peer", "upstream", toxicity, map[string]any{"timeout": 0})
}

// Partition cuts the link for d: no data crosses it either way, and
// connections do not answer (as when a network drops packets), until it
// heals on its own after d (Heal heals it sooner). What was sent across it
// is lost, and the connections that were open across it are closed when it
// heals, as a peer's TCP gives up on a connection that lost data; a close
// (FIN) still crosses it. A second Partition replaces the first, its
// length counted from then.
func (l *Link) Partition(d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%w: partition of %s", ErrInvalidFault, d)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.cut++
	cut := l.cut
	if err := l.both("timeout", 1, map[string]any{"timeout": 0}); err != nil {
		return err
	}
	l.timer = time.AfterFunc(d, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.cut == cut { // not replaced, nor healed, since
			l.remove("timeout")
		}
	})
	return nil
}

// Heal removes every fault: the link carries everything again, at once.
func (l *Link) Heal() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.timer != nil {
		l.timer.Stop()
	}
	l.cut++
	for _, n := range append([]string(nil), l.faults...) {
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

// add puts a toxic in place, replacing one of the same kind and
// direction. The caller holds l.mu, as for both, remove and removeNamed.
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
	l.faults = append(l.faults, name)
	return nil
}

// remove removes the toxics of kind, both directions.
func (l *Link) remove(kind string) {
	for _, stream := range []string{"upstream", "downstream"} {
		l.removeNamed(kind + "_" + stream)
	}
}

func (l *Link) removeNamed(name string) {
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
	if found {
		_ = l.proxy.Toxics.RemoveToxic(context.Background(), name)
	}
}
