package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/internal/testout"
)

// sum adds the values of family name's series whose labels include
// labels (pairs), counters and gauges alike.
func sum(fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	var total float64
	for _, m := range matching(fams, name, labels...) {
		total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return total
}

// matching are the series of family name whose labels include labels
// (pairs).
func matching(fams map[string]*dto.MetricFamily, name string, labels ...string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range fams[name].GetMetric() {
		have := map[string]string{}
		for _, l := range m.GetLabel() {
			have[l.GetName()] = l.GetValue()
		}
		ok := true
		for i := 0; i+1 < len(labels); i += 2 {
			ok = ok && have[labels[i]] == labels[i+1]
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

// series counts the series of family name whose labels include labels.
func series(fams map[string]*dto.MetricFamily, name string, labels ...string) int {
	return len(matching(fams, name, labels...))
}

// histogramCount adds the sample counts of histogram name's series whose
// labels include labels.
func histogramCount(fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	var n float64
	for _, m := range matching(fams, name, labels...) {
		n += float64(m.GetHistogram().GetSampleCount())
	}
	return n
}

// -metrics-addr serves the workers' metrics while the demo runs and
// serves: the counts of a run match its report.
func TestMetricsAddrServesTheRun(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	var stdout, stderr testout.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"-orders", "12", "-json", "-serve", "-metrics-addr", "127.0.0.1:0"}, &stdout, &stderr)
	}()
	bound, cancelBound := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancelBound()
	stderr.WaitFor(bound, t, "serving operator requests")
	m := regexp.MustCompile(`metrics: serving (http://127\.0\.0\.1:\d+/metrics)\n`).FindStringSubmatch(stderr.String())
	require.NotNil(t, m, "the address is printed: %s", stderr.String())
	s := lastJSON(t, stdout.String())

	resp, err := http.Get(m[1])
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	require.NoError(t, err)

	assert.Equal(t, float64(s.Sagas), sum(fams, "pgsaga_sagas_started_total"), "every saga of the run started here")
	assert.Equal(t, float64(s.Completed), sum(fams, "pgsaga_sagas_finished_total", "outcome", "completed"))
	assert.Equal(t, float64(s.Compensated), sum(fams, "pgsaga_sagas_finished_total", "outcome", "compensated"))
	assert.Zero(t, sum(fams, "pgsaga_sagas_in_flight"))
	assert.Equal(t, float64(s.Completed), histogramCount(fams, "pgsaga_saga_duration_seconds", "outcome", "completed"), "each finished saga's duration")
	assert.Equal(t, float64(s.Compensated), histogramCount(fams, "pgsaga_saga_duration_seconds", "outcome", "compensated"))
	// A registered saga's gauges read 0 when none of its instances is so.
	assert.Equal(t, 1, series(fams, "pgsaga_sagas_parked", "saga", "order-payment"), "parked reads 0, not nothing")
	assert.Equal(t, 1, series(fams, "pgsaga_sagas_in_flight", "saga", "order-payment", "status", "running"))
	assert.Equal(t, 1, series(fams, "pgsaga_sagas_in_flight", "saga", "order-payment", "status", "compensating"))
	problems, err := promlint.New(bytes.NewReader(body)).Lint()
	require.NoError(t, err)
	assert.Empty(t, problems, "the scrape follows Prometheus' conventions")
	assert.NotEmpty(t, fams["pgsaga_consumer_depth"].GetMetric(), "the database's gauges are there")
	assert.Contains(t, fams, "go_goroutines", "and the process's")
	cancel()
	select {
	case code := <-done:
		assert.Equal(t, exitOK, code, stderr.String())
	case <-bound.Done():
		t.Fatal("still serving after its context ended")
	}
	_, err = http.Get(m[1])
	assert.Error(t, err, "the metrics server stops with the program")
}

func TestMetricsAddrIsChecked(t *testing.T) {
	for _, bad := range []string{"9090", "localhost", "127.0.0.1:port"} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), []string{"-metrics-addr", bad}, &stdout, &stderr)
		assert.Equal(t, exitUsage, code, bad)
		assert.Contains(t, stderr.String(), "-metrics-addr", bad)
		assert.Equal(t, 1, strings.Count(stderr.String(), "\n"), "one line: %s", stderr.String())
	}
}
