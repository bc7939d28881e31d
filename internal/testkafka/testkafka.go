// Package testkafka gives tests a Kafka cluster, with nothing installed:
// KAFKA_BROKERS if set (a broker that does not answer fails the test),
// else a cluster of the test's own, in its process, that speaks Kafka's
// wire protocol (github.com/twmb/franz-go/pkg/kfake), so that the real
// client (sarama, through watermill-kafka) is what is tested. A cluster
// keeps its data in the test's temporary directory and listens on ports of
// its own, so the test can stop it and start it again, as a broker restart.
package testkafka

import (
	"fmt"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
)

// Brokers returns the bootstrap brokers of a Kafka cluster for the test:
// KAFKA_BROKERS's, else those of a cluster of its own (Start).
func Brokers(t testing.TB) []string {
	t.Helper()
	if env := os.Getenv("KAFKA_BROKERS"); env != "" {
		list := strings.Split(env, ",")
		conn, err := net.DialTimeout("tcp", list[0], 5*time.Second)
		if err != nil {
			t.Fatalf("no Kafka broker answers at %s, which KAFKA_BROKERS names (%v): start it or unset KAFKA_BROKERS", list[0], err)
		}
		_ = conn.Close()
		return list
	}
	return Start(t).Brokers()
}

// Cluster is a Kafka cluster of the test's own, in its process.
type Cluster struct {
	t     testing.TB
	dir   string
	ports []int
	opts  []kfake.Opt
	c     *kfake.Cluster
}

// Start starts a cluster of three brokers (with opts: SASL, say), closed
// when the test ends.
func Start(t testing.TB, opts ...kfake.Opt) *Cluster {
	t.Helper()
	c := &Cluster{t: t, dir: t.TempDir(), opts: opts}
	c.start()
	for _, a := range c.c.ListenAddrs() {
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatalf("testkafka: %v", err)
		}
		var p int
		_, _ = fmt.Sscan(port, &p)
		c.ports = append(c.ports, p)
	}
	t.Cleanup(c.Stop)
	return c
}

func (c *Cluster) start(how ...kfake.Opt) {
	c.t.Helper()
	opts := append([]kfake.Opt{kfake.NumBrokers(3), kfake.DataDir(c.dir), kfake.SyncWrites()}, how...)
	cl, err := kfake.NewCluster(append(opts, c.opts...)...)
	if err != nil {
		c.t.Fatalf("testkafka: starting a cluster: %v", err)
	}
	c.c = cl
}

// Brokers are the cluster's bootstrap brokers; they stay the same across
// restarts.
func (c *Cluster) Brokers() []string {
	out := make([]string, len(c.ports))
	for i, p := range c.ports {
		out[i] = fmt.Sprintf("127.0.0.1:%d", p)
	}
	return out
}

// Stop stops the cluster: its listeners close and its clients' requests
// fail until Start.
func (c *Cluster) Stop() {
	if c.c != nil {
		c.c.Close()
		c.c = nil
	}
}

// Start starts the cluster again, on the same ports, with the data it had
// stored.
func (c *Cluster) Start() {
	c.t.Helper()
	if c.c != nil {
		return
	}
	c.start(kfake.Ports(c.ports...))
}

// Kafka is the running cluster, for a test that injects faults
// (kfake.Cluster.Control); nil while stopped.
func (c *Cluster) Kafka() *kfake.Cluster { return c.c }
