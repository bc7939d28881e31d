package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/pgsaga/pgsaga/internal/testdb"
	"github.com/pgsaga/pgsaga/saga/orderpayment"
)

// With no orders there is no latency to report: the table says so instead
// of "p50 0ms".
func TestNoOrdersNoLatency(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-orders", "0"}, &stdout, &stderr), stderr.String())
	line := regexp.MustCompile(`(?m)^  latency .*$`).FindString(stdout.String())
	require.NotEmpty(t, line, stdout.String())
	assert.NotContains(t, line, "0ms")
	assert.Contains(t, line, "none")
}

// The chaos report lists the gateway's faults sorted and readable, not as a
// Go map.
func TestChaosReportListsFaultsReadably(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	d := &demo{out: &out}
	d.printTable(summary{Sagas: 3, Completed: 3, InvariantsOK: true,
		Chaos: &chaosSummary{GatewayFaults: map[string]int{"slow": 4, "decline": 1, "lost": 4, "unavailable": 1}}})
	assert.NotContains(t, out.String(), "map[")
	assert.Contains(t, out.String(), "gateway faults lost 4, slow 4, decline 1, unavailable 1 (all runs)")

	out.Reset()
	d.printTable(summary{Chaos: &chaosSummary{GatewayFaults: map[string]int{}}})
	assert.Contains(t, out.String(), "gateway faults none (all runs)")
}

// Counts of one are singular.
func TestOneIsSingular(t *testing.T) {
	t.Setenv("DATABASE_URL", testdb.Fresh(t).URL)
	var stdout, stderr bytes.Buffer
	require.Equal(t, exitOK, run(context.Background(), []string{"-orders", "1", "-seed", "1", "-duplicate-rate", "0.01"}, &stdout, &stderr), stderr.String())
	all := stdout.String() + stderr.String()
	assert.Contains(t, all, "placing 1 order of")
	plural := regexp.MustCompile(`\b1 (orders|sagas|customers|workers|charges|refunds|calls|messages|copies|crashes|connections|attempts|retries|commands)\b`)
	assert.Empty(t, plural.FindAllString(all, -1), all)
}

// -resume counts the sagas it resumes before any worker runs: counted
// after, the sagas the workers finished meanwhile went missing from the
// count and the report.
func TestResumeCountsEveryUnfinishedSaga(t *testing.T) {
	t.Parallel() // beside the package's other runs of the sample
	db := testdb.Fresh(t)
	getenv := env("DATABASE_URL", db.URL)
	var stdout, stderr bytes.Buffer
	// Give up almost at once, leaving most sagas half-way.
	code := runEnv(context.Background(), getenv, []string{"-orders", "300", "-timeout", "200ms"}, &stdout, &stderr)
	require.Equal(t, exitFailed, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	var unfinished int
	require.NoError(t, db.SQL.QueryRow(`SELECT count(*) FROM (`+unfinishedSQL+`) u`, orderpayment.Name).Scan(&unfinished))
	require.Positive(t, unfinished, "sagas are left to resume")

	stdout.Reset()
	stderr.Reset()
	require.Equal(t, exitOK, runEnv(context.Background(), getenv, []string{"-resume", "-json", "-workers", "8"}, &stdout, &stderr), stderr.String())
	s := lastJSON(t, stdout.String())
	assert.Equal(t, unfinished, s.Sagas, "every saga unfinished when the run began")
	assert.Contains(t, stderr.String(), "resuming "+plural(unfinished, "unfinished saga", "unfinished sagas")+"\n")
}

// A flag that does not parse costs one line naming it and pointing at -h,
// not the whole usage.
func TestFlagErrorIsOneLine(t *testing.T) {
	t.Parallel()
	for args, flag := range map[string]string{
		"-no-such-flag": "-no-such-flag",
		"-orders ten":   "-orders",
		"-seed -1":      "-seed",
		"-json=maybe":   "-json",
	} {
		var stdout, stderr bytes.Buffer
		assert.Equal(t, exitUsage, run(context.Background(), strings.Fields(args), &stdout, &stderr), args)
		msg := stderr.String()
		assert.Equal(t, 1, strings.Count(msg, "\n"), "%s: %q", args, msg)
		assert.Contains(t, msg, flag, args)
		assert.Contains(t, msg, "orderdemo -h", args)
		assert.Empty(t, stdout.String(), args)
	}
}
