package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

var metricsAtRe = regexp.MustCompile(`pgsaga ui: metrics at (http://\S+)\n`)

// The web view logs as JSON when asked, at the level asked, and serves
// Prometheus metrics of the database it reads (saga.Client.Collector's:
// sagas in flight and parked, consumer groups, whether the database
// answered) and of its process at --metrics-addr.
func TestUILogsAsJSONAndServesMetrics(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stderr testout.Buffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"ui", "--addr", "127.0.0.1:0", "--log-format", "json", "--log-level", "debug", "--metrics-addr", "127.0.0.1:0"}, io.Discard, &stderr)
	}()
	base := servingAt(t, &stderr)
	var m []string
	eventually(t, "the metrics line", func() bool { m = metricsAtRe.FindStringSubmatch(stderr.String()); return m != nil })

	resp, err := http.Get(base + "/healthz")
	require.NoError(t, err)
	_ = resp.Body.Close()
	resp, err = http.Get(m[1])
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	for _, name := range []string{"pgsaga_database_up 1", "go_goroutines", "process_cpu_seconds_total"} {
		assert.Contains(t, string(body), name)
	}
	cancel()
	assert.Equal(t, exitOK, <-done, stderr.String())

	requests := 0
	sc := bufio.NewScanner(strings.NewReader(stderr.String()))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "{") {
			continue // the program's own lines: serving, metrics, stopped
		}
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), line)
		if rec["msg"] == "request" {
			requests++
			assert.Equal(t, "DEBUG", rec["level"])
		}
	}
	assert.Equal(t, 1, requests, "one record for the request, as JSON: %s", stderr.String())
}

// A bad logging or metrics flag of relay and ui is a usage error (exit
// 2), found before anything starts.
func TestServeFlagsRefuseNonsense(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:1/nowhere?sslmode=disable&connect_timeout=2")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"ui", "--log-format", "xml"}, "--log-format must be text or json"},
		{[]string{"ui", "--log-level", "loud"}, "-log-level must be debug, info, warn or error"},
		{[]string{"ui", "-v", "--log-level", "info"}, "give one of them"},
		{[]string{"ui", "--metrics-addr", "nowhere"}, "want host:port"},
		{[]string{"ui", "--metrics-addr", "0.0.0.0:0"}, "off loopback"},
		{[]string{"relay", "--broker", "nats://127.0.0.1:4222", "--topic", "t", "--metrics-addr", ":9090"}, "give --metrics-public"},
		{[]string{"relay", "--broker", "nats://127.0.0.1:4222", "--topic", "t", "--log-format", "xml"}, "--log-format must be text or json"},
		{[]string{"relay", "--broker", "nats://127.0.0.1:4222", "--topic", "t", "--metrics-addr", "1:2:3"}, "want host:port"},
	} {
		start := time.Now()
		code, _, errOut := pgsaga(t, c.args...)
		assert.Equal(t, exitUsage, code, "%v: %s", c.args, errOut)
		assert.Contains(t, errOut, c.want, "%v", c.args)
		assert.Less(t, time.Since(start), 2*time.Second, "%v: refused before connecting", c.args)
	}
	code, _, errOut := pgsaga(t, "ui", "--metrics-addr", "0.0.0.0:0", "--metrics-public")
	assert.Equal(t, exitFailed, code, "--metrics-public lets it past the flags, to the (unreachable) database: %s", errOut)
}
