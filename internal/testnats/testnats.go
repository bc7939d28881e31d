// Package testnats finds a NATS server with JetStream for tests, the way
// internal/testdb finds PostgreSQL: NATS_URL, else 127.0.0.1:4222. With
// none reachable a test skips, saying so in one sentence, except under CI
// (CI set), where .ci/run starts one and its absence is a failure.
package testnats

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultURL is where tests look for NATS when NATS_URL is unset.
const DefaultURL = "nats://127.0.0.1:4222"

// URL returns the URL of a NATS server with JetStream enabled, or skips
// (fails under CI) when there is none.
func URL(t testing.TB) string {
	t.Helper()
	url := os.Getenv("NATS_URL")
	if url == "" {
		url = DefaultURL
	}
	if err := check(url); err != nil {
		msg := fmt.Sprintf("no NATS server with JetStream at %s (%v): start one with `nats-server -js` or set NATS_URL", url, err)
		if os.Getenv("CI") != "" {
			t.Fatal(msg + "; .ci/run starts one where nats-server is installed")
		}
		t.Skip(msg)
	}
	return url
}

// Connect connects to URL(t) and closes the connection when the test ends.
func Connect(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(URL(t), nats.Timeout(5*time.Second))
	if err != nil {
		t.Fatalf("connecting to NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("JetStream: %v", err)
	}
	return nc, js
}

func check(url string) error {
	nc, err := nats.Connect(url, nats.Timeout(2*time.Second), nats.MaxReconnects(0))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		return fmt.Errorf("JetStream: %w", err)
	}
	return nil
}
